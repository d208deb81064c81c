"""Mixture-of-experts serving over ranks, in one run: one rank, tensor parallelism splitting every expert,
and expert parallelism (whole experts per rank, all-to-all dispatch), with the all-to-all time per step.

    python benchmarks/ep.py             # tiny-moe, 8 prompts x 32 new tokens, 2 ranks
    python benchmarks/ep.py --quick     # fewer tokens: a smoke test
    python benchmarks/ep.py --preset qwen3-30b-a3b-mini

Ranks are processes on this machine's cores (gloo). Dual-batch overlap (enable_dbo) splits each sparse layer's
tokens into two micro-batches whose all-to-alls and expert compute interleave. Each figure is the best of
--repeats runs of the same greedy batch.
"""

from __future__ import annotations

import argparse
import time
import warnings

import transformers

from rlserve.bench.machine import cpu_info, describe
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.expert_parallel import expert_stats
from rlserve.model.make import bench_cache_dir, make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads-per-rank", type=int, default=1, help="1: a rank a core, no thread oversubscription")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.new_tokens, args.repeats = 2, 4, 1
    return args


def measure(model_dir, args, prompts, **parallel) -> tuple[float, int, float]:
    """(generated tokens/s, engine steps, rank 0's all-to-all seconds per step) of the best repeat."""
    cfg = Config.model_validate(
        {
            "model": {"name": str(model_dir), "max_model_len": 512},
            "engine": {"kv_cache_bytes": 32 << 20, "enable_prefix_caching": False},
            "parallel": parallel,
            "num_threads": args.threads_per_rank,
        }
    )
    engine = Engine(cfg)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    try:
        engine.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm up
        best, steps, a2a_per_step = 0.0, 0, 0.0
        for _ in range(args.repeats):
            a2a_before, steps_before = (
                expert_stats(engine.model).get("ep_all_to_all_seconds", 0.0),
                engine.stats.num_steps,
            )
            start = time.perf_counter()
            outs = engine.generate(prompts, params)
            elapsed = time.perf_counter() - start
            rate = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
            if rate > best:
                steps = engine.stats.num_steps - steps_before
                a2a = expert_stats(engine.model).get("ep_all_to_all_seconds", 0.0) - a2a_before
                best, a2a_per_step = rate, a2a / max(1, steps)
        return best, steps, a2a_per_step
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    import random

    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(args.prompt_len)] for _ in range(args.prompts)]
    n = args.ranks
    print(
        f"{args.preset}: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new (greedy), "
        f"{args.threads_per_rank} thread(s) a rank"
    )
    print(describe(cpu_info()))
    print(f"{'setup':34} {'tok/s':>8} {'steps':>6} {'all-to-all ms/step':>19}")
    rows = [
        ("tp=1 (one rank)", {}),
        (f"tp={n}, experts split (no EP)", {"tp": n}),
        (f"EP over {n} ranks", {"tp": n, "enable_expert_parallel": True}),
        (f"EP over {n} ranks + dbo", {"tp": n, "enable_expert_parallel": True, "enable_dbo": True}),
    ]
    rates = {}
    for name, parallel in rows:
        rate, steps, a2a = measure(model_dir, args, prompts, **parallel)
        rates[name] = rate
        print(f"{name:34} {rate:8.1f} {steps:6d} {a2a * 1000:19.2f}")
    ep, dbo = rates[rows[2][0]], rates[rows[3][0]]
    print(f"dbo / EP: {dbo / ep:.3f}; EP / tp=1: {ep / rates[rows[0][0]]:.3f}")


if __name__ == "__main__":
    main()
