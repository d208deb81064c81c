"""The cost of batch-invariant mode: rlserve's offline throughput with `engine.batch_invariant` on and off.

Two engines in one process on the same random-weight model (default: a SmolLM2-135M shape, fp32),
the same workloads, run in alternation (default, invariant, default, invariant, ...) so that load
from other processes on shared cores lands on both: each round gives one ratio, and the table shows
the median ratio with its spread over rounds.

    python benchmarks/batch_invariant.py                 # ~5 min on a quiet 2-core CPU
    python benchmarks/batch_invariant.py --quick         # tiny model, smoke test

Workloads (fresh random prompts every run: no prefix-cache hits across runs):
- batch: 8 prompts x n=8, 64-token prompts, 64 new tokens (RL rollouts: decode-bound, 64 rows);
- single: 1 prompt, n=1, 64 + 64 tokens (batch-1 latency);
- prefill: 16 prompts of 256 tokens, n=1, 8 new tokens (prompt-heavy).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.cpu_kernels import _cpu_id
from rlserve.model.make import bench_cache_dir, make_model

WORKLOADS = {  # name: (prompts, prompt length, n, new tokens)
    "batch": (8, 64, 8, 64),
    "single": (1, 64, 1, 64),
    "prefill": (16, 256, 1, 8),
}


def make_engine(model_dir: Path, invariant: bool, dtype: str, device: str = "cpu") -> Engine:
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.dtype = dtype
    cfg.model.device = device
    cfg.model.max_model_len = 1024
    cfg.engine.kv_cache_bytes = 256 << 20
    cfg.engine.batch_invariant = invariant
    return Engine(cfg)


def run(engine: Engine, workload: tuple[int, int, int, int], rng: random.Random) -> float:
    """Generated tokens per second of one run."""
    prompts, length, n, new = workload
    ids = [[rng.randrange(100, engine.vocab_size) for _ in range(length)] for _ in range(prompts)]
    params = SamplingParams(n=n, temperature=1.0, max_tokens=new, ignore_eos=True, seed=rng.randrange(1 << 30),
                            logprobs=0, detokenize=False)  # fmt: skip
    start = time.perf_counter()
    outs = engine.generate(ids, params)
    seconds = time.perf_counter() - start
    return sum(len(c.token_ids) for o in outs for c in o.outputs) / seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5, help="alternating default/invariant pairs per workload")
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    p.add_argument(
        "--small", action="store_true", help="each workload at a quarter of its sequences and half its tokens"
    )
    args = p.parse_args(argv)
    if args.small:
        for name, (prompts, length, n, new) in WORKLOADS.items():
            WORKLOADS[name] = (max(1, prompts // 2), length // 2, max(1, n // 2), new // 2)
    if args.quick:
        args.preset, args.rounds = "tiny", 2
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    flags = {f for f in _cpu_id().split() if f.startswith(("avx", "amx", "fma"))}
    print(
        f"# {args.preset} {args.dtype}, torch threads {torch.get_num_threads()}, CPU flags: {' '.join(sorted(flags))}"
    )
    engines = {
        "default": make_engine(model_dir, False, args.dtype),
        "invariant": make_engine(model_dir, True, args.dtype),
    }
    rng = random.Random(0)
    for engine in engines.values():  # warm-up: kernels built, weights packed, allocator warm
        run(engine, (1, 16, 2, 4), rng)
    print(
        "| workload | default tok/s (median) | invariant tok/s (median) | invariant/default per round: median [min, max] |"
    )
    print("|---|---|---|---|")
    for name in args.workloads:
        rates: dict[str, list[float]] = {"default": [], "invariant": []}
        for r in range(args.rounds):
            order = ("default", "invariant") if r % 2 == 0 else ("invariant", "default")
            for which in order:
                rates[which].append(run(engines[which], WORKLOADS[name], rng))
        ratios = [i / d for d, i in zip(rates["default"], rates["invariant"])]
        print(
            f"| {name} | {statistics.median(rates['default']):.1f} | {statistics.median(rates['invariant']):.1f} "
            f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |",
            flush=True,
        )


if __name__ == "__main__":
    main()
