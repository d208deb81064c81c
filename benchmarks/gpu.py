"""The CUDA path, checked and measured on one GPU: rlserve's engine against transformers on the same card.

1. Exactness: greedy ids and per-token logprobs from rlserve's engine against one transformers forward
   pass of the same tokens on the same GPU, in float32 and bfloat16, with CUDA graphs on and off.
2. Throughput: rlserve's offline engine against transformers' continuous batching (`generate_batch`)
   on the same random-weight model and workload: C distinct random prompts at once (C = 1, 64, 256),
   a fixed number of new tokens, temperature 1, EOS ignored. At batch 1 it also prints the share of
   the card's measured memory bandwidth that decode uses (weight bytes x tokens/s over a device copy's
   bandwidth).

    python benchmarks/gpu.py                       # smollm2-135m and qwen3-0.6b presets, bf16
    python benchmarks/gpu.py --quick               # tiny preset, small counts: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model

TARGET_VS_GENERATE_BATCH = 3.0  # at 64 concurrent (the issue's goal)
TARGET_BANDWIDTH_SHARE = 0.5  # at batch 1
CB_PAGE_SIZE = 32
DEVICE = "cuda"  # --device cpu runs the same script as a smoke test on a machine without a GPU


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["smollm2-135m", "qwen3-0.6b"])
    p.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per point; the fastest is kept")
    p.add_argument("--skip-check", action="store_true", help="skip the exactness check")
    p.add_argument("--skip-bench", action="store_true", help="skip the throughput runs")
    p.add_argument("--skip-generate-batch", action="store_true")
    p.add_argument("--json", type=Path, help="write every figure here")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu: a smoke test of the script itself")
    p.add_argument("--cache-dir", type=Path, default=bench_cache_dir())
    args = p.parse_args(argv)
    if args.quick:
        args.presets, args.concurrency, args.new_tokens, args.repeats = ["tiny"], [1, 8], 16, 1
    return args


def device_bandwidth(gib: float = 2.0) -> float:
    """Bytes per second of a large device-to-device copy, counting bytes read plus bytes written."""
    n = int(gib * (1 << 30)) // 4
    src, dst = torch.randn(n, device=DEVICE), torch.empty(n, device=DEVICE)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return 2 * n * 4 / sorted(times[2:])[len(times[2:]) // 2]


def engine_for(model_dir: Path, dtype: str, graphs: bool, max_len: int, max_seqs: int) -> Engine:
    cfg = Config(seed=0)
    cfg.model.name, cfg.model.dtype, cfg.model.device = str(model_dir), dtype, DEVICE
    cfg.model.enforce_eager = not graphs
    cfg.model.max_model_len = max(512, max_len)
    cfg.engine.max_num_seqs = max(8, max_seqs)
    cfg.engine.max_num_batched_tokens = max(2048, max_seqs * 64)
    return Engine(cfg)


def load_hf(model_dir: Path, dtype: str, attn: str = "sdpa") -> transformers.PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), attn_implementation=attn)
    return model.to(DEVICE).eval()


def random_prompts(k: int, length: int, vocab: int, seed: int, ragged: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(max(2, length // 4), length + 1, (k,), generator=g).tolist() if ragged else [length] * k
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


# ---- 1. exactness -------------------------------------------------------------------------------


def check(model_dir: Path, dtype: str, graphs: bool, hf, hf32) -> dict:
    """Greedy 24 tokens for 8 ragged prompts. Reference: the same-dtype transformers forward (and the
    fp32 one for bf16). ids: positions where rlserve's token is not the reference's argmax given the
    same prefix (teacher-forced, so one early tie does not count every later token)."""
    engine = engine_for(model_dir, dtype, graphs, 256, 8)
    prompts = random_prompts(8, 48, engine.vocab_size, seed=5, ragged=True)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0))
    row = {
        "dtype": dtype,
        "graphs": graphs,
        "tokens": 0,
        "id_mismatch": 0,
        "max_abs": 0.0,
        "mean_abs": 0.0,
        "max_abs_vs_fp32": 0.0,
        "graphed_steps": len(engine.runner.graphs.graphs) if engine.runner.graphs else 0,
    }
    total = 0.0
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ids = torch.tensor(comp.token_ids, device=DEVICE)
        for ref_model, key in ((hf, "max_abs"), (hf32, "max_abs_vs_fp32")):
            if ref_model is None:
                continue
            with torch.no_grad():
                logits = ref_model(torch.tensor([prompt + comp.token_ids], device=DEVICE)).logits[0].float()
            ref = torch.log_softmax(logits[len(prompt) - 1 : len(prompt) - 1 + len(ids)], dim=-1)
            got = torch.tensor(comp.logprobs, device=DEVICE)
            diff = (got - ref.gather(1, ids.unsqueeze(1)).squeeze(1)).abs()
            row[key] = max(row[key], diff.max().item())
            if key == "max_abs":
                total += diff.sum().item()
                row["id_mismatch"] += int((ref.argmax(-1) != ids).sum().item())
        row["tokens"] += len(ids)
    row["mean_abs"] = total / row["tokens"]
    engine = None  # frees the engine's device memory before the next one
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return row


# ---- 2. throughput ------------------------------------------------------------------------------


def time_best(run, repeats: int) -> tuple[int, float]:
    best = None
    for i in range(repeats):
        sync()
        t0 = time.perf_counter()
        tokens = run(i)
        sync()
        dt = time.perf_counter() - t0
        if best is None or dt < best[1]:
            best = (tokens, dt)
    return best


def bench_rlserve(model_dir: Path, dtype: str, concurrency: list[int], args, vocab: int) -> dict[int, float]:
    engine = engine_for(model_dir, dtype, True, args.prompt_len + args.new_tokens + 16, max(concurrency))
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine.generate(random_prompts(2, args.prompt_len, vocab, seed=-1), params)  # warm-up: captures graphs
    result = {}
    for c in concurrency:

        def run(i: int, c: int = c) -> int:
            outs = engine.generate(random_prompts(c, args.prompt_len, vocab, seed=1000 * c + i), params)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        tokens, seconds = time_best(run, args.repeats)
        result[c] = tokens / seconds
    engine = None  # frees the engine's device memory before the next one
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def bench_generate_batch(model_dir: Path, dtype: str, concurrency: list[int], args, vocab: int) -> dict[int, float]:
    try:
        model = load_hf(model_dir, dtype, "paged|sdpa")
    except ValueError:
        model = load_hf(model_dir, dtype, "sdpa")
    config = GenerationConfig(
        do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=args.new_tokens, eos_token_id=-1
    )
    max_len = args.prompt_len + args.new_tokens

    def run_prompts(prompts: list[list[int]]) -> int:
        cb = continuous_batching_config(
            page_size=CB_PAGE_SIZE,
            num_blocks=len(prompts) * -(-max_len // CB_PAGE_SIZE) + 1,
            max_batch_tokens=max(256, sum(len(p) for p in prompts)),
            seed=0,
        )
        with torch.no_grad():
            outs = model.generate_batch(prompts, generation_config=config, continuous_batching_config=cb)
        failed = [o.error for o in outs.values() if o.error is not None]
        if failed or len(outs) != len(prompts):
            raise RuntimeError(f"generate_batch returned {len(outs)}/{len(prompts)}; errors: {failed[:3]}")
        return sum(len(o.generated_tokens) for o in outs.values())

    run_prompts(random_prompts(2, args.prompt_len, vocab, seed=-1))
    result = {}
    for c in concurrency:
        tokens, seconds = time_best(
            lambda i, c=c: run_prompts(random_prompts(c, args.prompt_len, vocab, 1000 * c + i)), args.repeats
        )
        result[c] = tokens / seconds
    model = None  # frees the device memory before the next system
    gc.collect()
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def continuous_batching_config(**wanted) -> ContinuousBatchingConfig:
    """The config with the fields this transformers version knows (5.17 has no page_size; newer ones do)."""
    import inspect

    known = inspect.signature(ContinuousBatchingConfig).parameters
    return ContinuousBatchingConfig(**{k: v for k, v in wanted.items() if k in known})


def weight_bytes(model_dir: Path, dtype: str) -> int:
    """Bytes one decode step must read: every parameter once (a tied embedding counts once)."""
    c = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    params = {p.data_ptr(): p.numel() for p in model.parameters()}
    n = sum(params.values())
    if not c.get("tie_word_embeddings", False):  # the embedding table is read one row per token, not whole
        n -= c["vocab_size"] * c["hidden_size"]
    return n * getattr(torch, dtype).itemsize


def main(argv: list[str] | None = None) -> None:
    global DEVICE
    args = parse_args(argv)
    DEVICE = args.device
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if DEVICE == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.multi_processor_count} SMs, {props.total_memory / 2**30:.0f} GiB"
        bandwidth = device_bandwidth()
    else:
        name, bandwidth = "cpu (smoke test)", 20e9
    print(
        f"{name}; torch {torch.__version__}, transformers {transformers.__version__}; "
        f"device copy {bandwidth / 1e12:.2f} TB/s (read + write)"
    )
    figures: dict = {"device": name, "bandwidth": bandwidth, "check": [], "bench": []}
    for preset in args.presets:
        model_dir = make_model(preset, args.cache_dir / preset)
        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if not args.skip_check:
            hf32 = load_hf(model_dir, "float32")
            for dtype in ("float32", "bfloat16"):
                hf = hf32 if dtype == "float32" else load_hf(model_dir, dtype)
                for graphs in (False, True):
                    row = check(model_dir, dtype, graphs, hf, None if dtype == "float32" else hf32)
                    figures["check"].append({"preset": preset, **row})
                    print(
                        f"check {preset:<13} {dtype:<9} graphs={'on ' if graphs else 'off'} tokens {row['tokens']} "
                        f"id mismatches {row['id_mismatch']}  logprob |diff| max {row['max_abs']:.2e} "
                        f"mean {row['mean_abs']:.2e}"
                        + (f"  (vs fp32 forward: max {row['max_abs_vs_fp32']:.2e})" if dtype != "float32" else "")
                        + f"  graphs captured {row['graphed_steps']}"
                    )
                if hf is not hf32:
                    del hf
            del hf32
            gc.collect()
        if args.skip_bench:
            continue
        for dtype in args.dtype:
            ours = bench_rlserve(model_dir, dtype, args.concurrency, args, vocab)
            theirs = (
                {}
                if args.skip_generate_batch
                else bench_generate_batch(model_dir, dtype, args.concurrency, args, vocab)
            )
            wbytes = weight_bytes(model_dir, dtype)
            for c in args.concurrency:
                row = {
                    "preset": preset,
                    "dtype": dtype,
                    "concurrency": c,
                    "rlserve": ours[c],
                    "generate_batch": theirs.get(c),
                }
                line = f"bench {preset:<13} {dtype:<9} {c:>4} concurrent: rlserve {ours[c]:>9.1f} tok/s"
                if c in theirs:
                    ratio = ours[c] / theirs[c]
                    row["ratio"] = ratio
                    line += f"  generate_batch {theirs[c]:>9.1f} tok/s  {ratio:5.2f}x"
                    if c == 64:
                        line += f" (goal >= {TARGET_VS_GENERATE_BATCH}x: {'met' if ratio >= TARGET_VS_GENERATE_BATCH else 'missed'})"
                if c == 1:
                    share = wbytes * ours[c] / bandwidth
                    row["bandwidth_share"] = share
                    line += (
                        f"  weights {wbytes / 1e6:.0f} MB/token: {share:.1%} of the copy bandwidth "
                        f"(goal >= {TARGET_BANDWIDTH_SHARE:.0%}: {'met' if share >= TARGET_BANDWIDTH_SHARE else 'missed'})"
                    )
                figures["bench"].append(row)
                print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
