"""Offline generation throughput: rlserve's engine against transformers, measured in one run.

All systems run the same random-weight model (built once by `make_model`) on the same workload:
B random prompts x n samples each, a fixed number of new tokens, temperature 1, EOS ignored; then
the same at batch 1. tok/s = generated tokens / wall seconds of the whole call (prefill included).

    python benchmarks/throughput.py            # smollm2-135m shape, 8 prompts x n=8, 64 + 64 tokens
    python benchmarks/throughput.py --quick    # tiny model, small counts: a smoke test
    python benchmarks/throughput.py --dtype float32 bfloat16   # both precisions, every system, one run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from _cpu import OtherLoad, instruction_peaks  # noqa: E402
from rlserve.config.schema import Config  # noqa: E402
from rlserve.engine.engine import Engine  # noqa: E402
from rlserve.engine.params import SamplingParams  # noqa: E402
from rlserve.model.cpu_kernels import _cpu_id  # noqa: E402
from rlserve.model.make import bench_cache_dir, make_model  # noqa: E402

# From the issue, for the default workload on a 2-core CPU (fp32 smollm2-135m shape).
TARGET_BATCH_TOK_S = 300.0
TARGET_SINGLE_TOK_S = 45.0
TARGET_VS_GENERATE = 12.0
TARGET_VS_GENERATE_BATCH = 4.0
# bf16 on a CPU with native bf16 (issue 15): over rlserve fp32, and over generate_batch in bf16
TARGET_BF16_OVER_FP32 = {"batch": 2.5, "single": 1.6}
TARGET_BF16_VS_GENERATE_BATCH = 5.0
SHORT = {"float32": "", "bfloat16": " bf16"}  # row-name suffix: fp32 rows keep their plain names

RLSERVE, GENERATE, GENERATE_BATCH = "rlserve", "transformers generate", "transformers generate_batch"
CB_PAGE_SIZE = 32  # tokens per generate_batch cache page; the default 256 wastes memory on short sequences


@dataclass(slots=True)
class Workload:
    name: str  # "warmup", "batch" or "single"
    prompt_sets: list[list[list[int]]]  # the prompts of each timed repeat: fresh ones every time
    n: int
    new_tokens: int

    @property
    def prompts(self) -> list[list[int]]:
        return self.prompt_sets[0]

    def repeat(self, i: int) -> Workload:
        """The workload of the i-th timed run; a repeat never hits a prefix cache an earlier one left."""
        return replace(self, prompt_sets=[self.prompt_sets[i]])

    @property
    def num_seqs(self) -> int:
        return len(self.prompts) * self.n

    @property
    def max_len(self) -> int:
        return max(len(p) for prompts in self.prompt_sets for p in prompts) + self.new_tokens


@dataclass(slots=True)
class Result:
    system: str
    workload: str
    seqs: int
    tokens: int
    seconds: float
    others: float | None  # CPU cores other processes used meanwhile (None off Linux)
    dtype: str = "float32"

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


Runner = Callable[[Workload], int]  # runs a workload, returns the generated tokens it got back


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m", help="make_model preset (random weights)")
    p.add_argument("--batch-prompts", type=int, default=8, help="distinct prompts in the batch workload")
    p.add_argument("--n", type=int, default=8, help="samples per prompt (rlserve shares the prompt's KV)")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)), help="torch threads (default: all cores)"
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system and workload; the fastest is kept")
    p.add_argument("--skip-hf", action="store_true", help="skip transformers `generate`")
    p.add_argument("--skip-generate-batch", action="store_true", help="skip transformers `generate_batch`")
    p.add_argument(
        "--dtype", nargs="+", choices=list(SHORT), default=["float32"], help="model dtypes, each for every system"
    )
    p.add_argument("--quick", action="store_true", help="tiny preset and small counts (smoke test)")
    p.add_argument("--cache-dir", type=Path, default=bench_cache_dir())
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.batch_prompts, args.n, args.prompt_len, args.new_tokens = "tiny", 2, 2, 16, 8
    return args


def make_workloads(args: argparse.Namespace, vocab_size: int) -> tuple[Workload, list[Workload]]:
    """A warm-up workload (not timed) and the timed ones. Prompts are fresh random ids, so no run
    hits a prefix cache left by another."""
    g = torch.Generator().manual_seed(args.seed)

    def prompts(k: int) -> list[list[int]]:
        return torch.randint(0, vocab_size, (k, args.prompt_len), generator=g).tolist()

    warmup = Workload("warmup", [prompts(1)], 2, min(4, args.new_tokens))
    timed = [
        Workload("batch", [prompts(args.batch_prompts) for _ in range(args.repeats)], args.n, args.new_tokens),
        Workload("single", [prompts(1) for _ in range(args.repeats)], 1, args.new_tokens),
    ]
    return warmup, timed


# ---- the systems: each loads its model and returns a runner ---------------------------------


def rlserve_runner(model_dir: Path, workloads: list[Workload], args, dtype: str) -> tuple[Runner, dict[str, dict]]:
    """The runner, and the engine stats of its last run of each workload."""
    cfg = Config(num_threads=args.threads, seed=args.seed)
    cfg.model.name, cfg.model.dtype = str(model_dir), dtype
    cfg.model.max_model_len = max(512, max(w.max_len for w in workloads))
    cfg.engine.kv_cache_bytes = kv_bytes_for(
        model_dir, workloads, cfg.engine.block_size, cfg.model.max_model_len, dtype
    )
    engine = Engine(cfg)
    stats: dict[str, dict] = {}

    def run(w: Workload) -> int:
        params = SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens, ignore_eos=True, seed=args.seed)
        before = asdict(engine.stats)
        outs = engine.generate(w.prompts, params)
        stats[w.name] = stats_delta(before, asdict(engine.stats))
        return sum(len(c.token_ids) for o in outs for c in o.outputs)

    return run, stats


def kv_bytes_for(model_dir: Path, workloads: list[Workload], block_size: int, min_tokens: int, dtype: str) -> int:
    """A KV pool that holds every sequence of the largest workload unshared, plus slack."""
    c = json.loads((model_dir / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    per_token = c["num_hidden_layers"] * 2 * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim
    per_token *= getattr(torch, dtype).itemsize
    tokens = max(w.num_seqs * (w.max_len + block_size) for w in workloads)
    return max(tokens, min_tokens + block_size) * per_token


# transformers is imported where a comparison needs it, and only the names each version has: the
# script runs under every version pyproject allows (4.51 has no `dtype=`, no generate_batch).


def load_hf(model_dir: Path, attn: str, dtype: str):
    import transformers
    from transformers import AutoModelForCausalLM

    # `dtype=` replaced `torch_dtype=` in 4.56; older versions take an unknown keyword as a config field
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=attn, **{key: getattr(torch, dtype)}
    ).eval()


def generate_batch_missing() -> str | None:
    """Why this transformers cannot run the generate_batch comparison, or None when it can."""
    import transformers

    if not hasattr(transformers, "ContinuousBatchingConfig"):
        return (
            f"transformers {transformers.__version__} has no ContinuousBatchingConfig (generate_batch as measured here)"
        )
    return None


def generate_runner(model_dir: Path, args, dtype: str) -> Runner:
    """Static batch: every sequence of a workload in one batch (prompts have equal lengths, so no padding)."""
    from transformers import GenerationConfig

    model = load_hf(model_dir, "sdpa", dtype)
    torch.manual_seed(args.seed)

    def run(w: Workload) -> int:
        ids = torch.tensor(w.prompts)
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=w.n,
            max_new_tokens=w.new_tokens,
            min_new_tokens=w.new_tokens,  # EOS masked: every row runs to the end
        )
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
        return out.shape[0] * (out.shape[1] - ids.shape[1])

    return run


def generate_batch_runner(model_dir: Path, args, dtype: str) -> Runner:
    """Continuous batching, under no_grad: inference_mode fails on CPU."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    try:
        model = load_hf(model_dir, "paged|sdpa", dtype)
    except ValueError:  # a transformers that dropped the "paged|" prefix
        model = load_hf(model_dir, "sdpa", dtype)

    def run(w: Workload) -> int:
        config = GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=w.n,
            max_new_tokens=w.new_tokens,
            eos_token_id=-1,  # -1: no EOS
        )
        cb = ContinuousBatchingConfig(
            page_size=CB_PAGE_SIZE,
            num_blocks=w.num_seqs * -(-w.max_len // CB_PAGE_SIZE) + 1,  # sized from the workload, not free memory
            max_batch_tokens=max(256, sum(len(p) for p in w.prompts)),
            seed=args.seed,
        )
        with torch.no_grad():
            outs = model.generate_batch(w.prompts, generation_config=config, continuous_batching_config=cb)
        failed = [o.error for o in outs.values() if o.error is not None]
        if failed or len(outs) != w.num_seqs:
            raise RuntimeError(f"generate_batch returned {len(outs)}/{w.num_seqs} sequences; errors: {failed[:3]}")
        return sum(len(o.generated_tokens) for o in outs.values())

    return run


# ---- timing and report ----------------------------------------------------------------------


def measure(
    system: str, run: Runner, warmup: Workload, timed: list[Workload], repeats: int, dtype: str
) -> list[Result]:
    run(warmup)
    results = []
    for w in timed:
        best = None
        for i in range(repeats):
            with OtherLoad() as load:
                t0 = time.perf_counter()
                tokens = run(w.repeat(i))
                dt = time.perf_counter() - t0
            if best is None or dt < best.seconds:
                best = Result(system + SHORT[dtype], w.name, w.num_seqs, tokens, dt, load.cores, dtype)
        results.append(best)
    return results


def stats_delta(before: dict, after: dict) -> dict:
    """Counters as the run's own increments; gauges (running, usage, blocks) as they are after it."""
    counters = (
        "num_preemptions",
        "prefix_cache_queries",
        "prefix_cache_hits",
        "prompt_tokens_computed",
        "generation_tokens",
    )
    return {k: after[k] - before[k] if k in counters else after[k] for k in after}


def target(r: Result, ours: Result | None, fp32: Result | None) -> str:
    """The issue's goal for this row, met or missed (fp32: absolute and over the peers; bf16: over
    rlserve fp32 and over generate_batch bf16, on a CPU with native bf16)."""
    if r.dtype == "bfloat16":
        if r is ours and fp32 is not None:
            goal, got = TARGET_BF16_OVER_FP32[r.workload], r.tok_s / fp32.tok_s
            return f"{got:.2f}x rlserve fp32 (>= {goal}x: {'met' if got >= goal else 'missed'})"
        goals = {GENERATE_BATCH + SHORT["bfloat16"]: TARGET_BF16_VS_GENERATE_BATCH}
    elif r.system == RLSERVE:
        goal = TARGET_BATCH_TOK_S if r.workload == "batch" else TARGET_SINGLE_TOK_S
        return f">= {goal:.0f} tok/s: {'met' if r.tok_s >= goal else 'missed'}"
    else:
        goals = {GENERATE: TARGET_VS_GENERATE, GENERATE_BATCH: TARGET_VS_GENERATE_BATCH}
    if r.system not in goals or r.workload != "batch" or ours is None:
        return ""
    goal = goals[r.system]
    return f"rlserve >= {goal:.0f}x: {'met' if ours.tok_s / r.tok_s >= goal else 'missed'}"


def report(
    results: list[Result],
    stats: dict[tuple[str, str], dict],
    timed: list[Workload],
    args,
    peaks: tuple[float, float] | None = None,
) -> None:
    print(
        f"\n{'system':<33} {'batch':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'rlserve/x':>10} {'others':>7}  target"
    )
    for w in timed:
        rows = [r for r in results if r.workload == w.name]
        fp32 = next((r for r in rows if r.system == RLSERVE), None)
        for r in rows:
            ours = next((o for o in rows if o.system == RLSERVE + SHORT[r.dtype]), None)
            ratio = "" if ours is None or r is ours else f"{ours.tok_s / r.tok_s:.1f}x"
            others = "" if r.others is None else f"{r.others:.2f}"
            goal = "" if args.quick else target(r, ours, fp32)
            print(
                f"{r.system:<33} {r.seqs:>5} {r.tokens:>7} {r.seconds:>8.2f} {r.tok_s:>8.1f} {ratio:>10} {others:>7}  {goal}"
            )
    print("rlserve/x = rlserve's tok/s in the row's dtype over the row's")
    print(
        f"others = CPU cores used by other processes during the run (of {os.cpu_count()}): "
        "well above 0 means the figures are low"
    )
    if not args.quick:
        print("targets (from the issue) are for the default workload on a 2-core CPU (bf16: one with native bf16)")
    if peaks is not None:
        fp32, bf16 = peaks
        print(
            f"this CPU's instruction peaks, 1 core: fp32 FMA {fp32:.0f} GFLOP/s, AVX512_BF16 dot {bf16:.0f} GFLOP/s "
            f"({bf16 / fp32:.2f}x; bf16 weights are 0.5x the bytes): the most bf16 can gain over an fp32 path "
            "running at its own peak" + ("; AMX not measured" if "amx_bf16" in _cpu_id() else "")
        )
    for (dtype, name), values in stats.items():
        print(f"\nrlserve {dtype} engine stats, {name} run (counters are this run's increments):")
        print("  " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in values.items()))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="The `paged|` prefix")  # 5.23 still needs it for generate_batch on CPU
    model_dir = make_model(args.preset, args.cache_dir / args.preset)
    warmup, timed = make_workloads(args, json.loads((model_dir / "config.json").read_text())["vocab_size"])
    print(f"model {args.preset} (random weights; {', '.join(args.dtype)}) at {model_dir}")
    print(
        f"workload: {args.batch_prompts} prompts x n={args.n}, {args.prompt_len} prompt + {args.new_tokens} new "
        f"tokens, temperature 1, EOS ignored; then 1 prompt x n=1; best of {args.repeats}"
    )
    print(
        f"torch {torch.__version__} ({args.threads} threads, {os.cpu_count()} cores), "
        f"transformers {transformers.__version__}"
    )

    results: list[Result] = []
    stats: dict[tuple[str, str], dict] = {}
    for dtype in args.dtype:
        run, dtype_stats = rlserve_runner(model_dir, timed, args, dtype)
        results += measure(RLSERVE, run, warmup, timed, args.repeats, dtype)
        stats.update({(dtype, w.name): dtype_stats[w.name] for w in timed})
        del run  # frees the engine
        gc.collect()
    for dtype in args.dtype:
        if not args.skip_hf:
            results += measure(GENERATE, generate_runner(model_dir, args, dtype), warmup, timed, args.repeats, dtype)
            gc.collect()
        if not args.skip_generate_batch and (missing := generate_batch_missing()) is not None:
            print(f"skipping transformers generate_batch: {missing}; pass --skip-generate-batch to silence this")
            args.skip_generate_batch = True
        if not args.skip_generate_batch:
            results += measure(
                GENERATE_BATCH, generate_batch_runner(model_dir, args, dtype), warmup, timed, args.repeats, dtype
            )
            gc.collect()
    peaks = instruction_peaks() if "bfloat16" in args.dtype and "float32" in args.dtype and not args.quick else None
    report(results, stats, timed, args, peaks)


if __name__ == "__main__":
    main()
