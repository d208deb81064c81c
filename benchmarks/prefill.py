"""Prefill speed against the machine's matmul peak: prompt tokens/s and time to first token by prompt length.

Prefill is matmul work, so its limit is the fastest GEMM this CPU runs. The script measures that
first (one prefill-shaped linear, 2048 x 576 by 576 x 1536, through every path torch offers here:
MKL's default, oneDNN's packed weight, rlserve's panel GEMM where it runs, and for bf16 the bf16 GEMM and fp32 arithmetic over bf16
weights), then runs rlserve's offline engine on fresh random prompts of each length with one new
token, and prints each figure as a share of that peak. FLOPs per prompt token = 2 x the projection
weights + attention's 2 x prompt length x (heads x head_dim) per layer (causal: half the full
square) + the LM head's row, spread over the prompt.

Without native bf16 (no avx512_bf16 / amx_bf16) a bf16 model's figures are marked emulated: the
bf16 peak is then the fastest correct path for bf16 weights, whatever arithmetic it uses.

    python benchmarks/prefill.py                          # fp32, smollm2-135m shape, 64..4096-token prompts
    python benchmarks/prefill.py --dtype float32 bfloat16 --json prefill.json
    python benchmarks/prefill.py --quick                  # tiny model, short prompts: a smoke test
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

import torch

from _cpu import OtherLoad
from rlserve.bench.limits import PEAK_SHAPE, ModelCost, matmul_peak
from rlserve.bench.machine import cpu_info, describe
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m", help="make_model preset (random weights)")
    p.add_argument("--lengths", type=int, nargs="+", default=[64, 512, 2048, 4096], help="prompt lengths")
    p.add_argument("--tokens", type=int, default=4096, help="prompt tokens per timed run (prompts = tokens / length)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per length; the median is reported")
    p.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="engine step budget (default: config's)")
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    p.add_argument("--quick", action="store_true", help="tiny preset, short prompts, one repeat (smoke test)")
    p.add_argument("--cache-dir", type=Path, default=bench_cache_dir())
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.lengths, args.tokens, args.repeats = "tiny", [16, 64], 128, 1
    return args


def flops_per_token(config: dict, prompt_len: int) -> float:
    return ModelCost.from_config(config, dtype_bytes=4).prompt_flops(prompt_len) / prompt_len


def run_engine(model_dir: Path, args, dtype: str, config: dict) -> list[dict]:
    cfg = Config(num_threads=args.threads, seed=0)
    cfg.model.name, cfg.model.dtype = str(model_dir), dtype
    longest = max(args.lengths)
    cfg.model.max_model_len = longest + 16
    if args.max_num_batched_tokens:
        cfg.engine.max_num_batched_tokens = args.max_num_batched_tokens
    per_token = config["num_hidden_layers"] * 2 * config.get("num_key_value_heads", config["num_attention_heads"])
    per_token *= (config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]) * 4
    cfg.engine.kv_cache_bytes = (max(args.tokens, longest) + 64 * 16 * 4) * per_token
    engine = Engine(cfg)
    gen = torch.Generator().manual_seed(1)
    vocab = config["vocab_size"]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def prompts(k: int, length: int) -> list[list[int]]:  # fresh ids: no run hits the prefix cache
        return torch.randint(0, vocab, (k, length), generator=gen).tolist()

    engine.generate(prompts(2, 32), params)  # warm-up: kernels, packing, first-call allocations
    rows = []
    for length in args.lengths:
        k = max(1, args.tokens // length)
        engine.generate(prompts(1, length), params)  # this length's first-call allocations
        batch, ttft, loads = [], [], []
        for _ in range(args.repeats):
            with OtherLoad() as load:
                t0 = time.perf_counter()
                engine.generate(prompts(k, length), params)
                batch.append(time.perf_counter() - t0)
            loads.append(load.cores)
            t0 = time.perf_counter()
            engine.generate(prompts(1, length), params)
            ttft.append(time.perf_counter() - t0)
        seconds = statistics.median(batch)
        rows.append(
            {
                "dtype": dtype,
                "prompt_len": length,
                "prompts": k,
                "prompt_tok_s": k * length / seconds,
                "ttft_s": statistics.median(ttft),
                "gflops_per_token": flops_per_token(config, length) / 1e9,
                "others": None if loads[0] is None else max(loads),
            }
        )
    del engine
    gc.collect()
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model_dir = make_model(args.preset, args.cache_dir / args.preset)
    config = json.loads((model_dir / "config.json").read_text())
    cpu = cpu_info()
    native_bf16 = cpu["native_bf16"]
    print(describe(cpu))
    print(
        f"torch {torch.__version__}, {args.threads} threads, {os.cpu_count()} cores; model {args.preset} at {model_dir}"
    )
    rows_k_n = "x".join(map(str, PEAK_SHAPE))
    peaks: dict[str, dict[str, float]] = {}
    for dtype in args.dtype:
        peaks[dtype] = matmul_peak(getattr(torch, dtype))
        emulated = dtype == "bfloat16" and not native_bf16
        note = " (no native bf16: bf16 arithmetic is emulated here)" if emulated else ""
        print(f"\nmatmul peak, {dtype}, one {rows_k_n} linear{note}:")
        for name, gflops in peaks[dtype].items():
            print(f"  {name:<42} {gflops:7.1f} GFLOP/s")

    results = []
    for dtype in args.dtype:
        rows = run_engine(model_dir, args, dtype, config)
        peak = max(peaks[dtype].values())
        for r in rows:
            r["emulated_bf16"] = dtype == "bfloat16" and not native_bf16
            r["share_of_peak"] = r["prompt_tok_s"] * r["gflops_per_token"] / peak
            r["peak_gflops"] = peak
        results += rows

    print(
        f"\n{'dtype':<16} {'prompt':>6} {'prompts':>7} {'prompt tok/s':>12} {'GFLOP/s':>8} {'of peak':>8} {'TTFT s':>8} {'others':>7}"
    )
    for r in results:
        dtype = r["dtype"] + (" (emul.)" if r["emulated_bf16"] else "")
        others = "" if r["others"] is None else f"{r['others']:.2f}"
        print(
            f"{dtype:<16} {r['prompt_len']:>6} {r['prompts']:>7} {r['prompt_tok_s']:>12.1f} "
            f"{r['prompt_tok_s'] * r['gflops_per_token']:>8.1f} {r['share_of_peak']:>8.0%} {r['ttft_s']:>8.3f} {others:>7}"
        )
    print(
        "of peak = prompt tok/s x GFLOP per token (projections, causal attention, the LM head's row) / the best matmul path above"
    )
    print(
        f"others = CPU cores other processes used during the timed runs (of {os.cpu_count()}): well above 0 means low figures"
    )
    if args.json:
        doc = {
            "cpu": cpu,
            "torch": torch.__version__,
            "threads": args.threads,
            "preset": args.preset,
            "peak_shape": PEAK_SHAPE,
            "matmul_gflops": peaks,
            "results": results,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
