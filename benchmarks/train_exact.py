"""The cost of true on-policy RL (issue 44), on both sides:

- the sampler: rlserve's offline throughput with `engine.batch_invariant` on against off (the `batch`
  workload of benchmarks/batch_invariant.py: 8 prompts x n=8, 64 + 64 tokens, RL rollouts);
- the trainer: one forward + backward of `rlserve.train.token_logprobs` (16 sequences, prompts of
  32-64 and completions of 32-64 tokens, right-padded) on a transformers model patched by
  `rlserve.train.patch` against the same model unpatched; and the forward alone. Both run the LM head
  on the completions' rows only (the rows the loss reads, as TRL's `logits_to_keep` does), so the
  difference is the patched side's own: its exact forward, and the backward's recompute.

Each side runs its two variants in alternation over rounds, so load from other processes lands on
both; the table gives medians and the median per-round ratio with its range. The cores other
processes used meanwhile are printed too (well above 0: a shared machine, the tok/s are low).

    python benchmarks/train_exact.py                  # smollm2-135m shape, fp32, 3 rounds
    python benchmarks/train_exact.py --dtype bfloat16
    python benchmarks/train_exact.py --quick          # tiny model, 2 rounds
    python benchmarks/train_exact.py --device cuda    # both sides on the GPU (Triton kernels)
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

import torch
from transformers import AutoModelForCausalLM

from _cpu import OtherLoad
from batch_invariant import WORKLOADS, make_engine
from batch_invariant import run as run_engine
from rlserve.model.cpu_kernels import _cpu_id
from rlserve.model.make import bench_cache_dir, make_model
from rlserve.train import patch, token_logprobs


def trainer_batch(vocab: int, rng: random.Random, sequences: int) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 64))] for _ in range(sequences)]
    completions = [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 64))] for _ in range(sequences)]
    return prompts, completions


def time_trainer(model, prompts, completions, backward: bool) -> float:
    """Tokens (prompt + completion) per second of one forward (+ backward)."""
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None
    synchronize()
    start = time.perf_counter()
    if backward:
        model.zero_grad(set_to_none=True)
        lps = token_logprobs(model, prompts, completions)
        torch.stack([lp.sum() for lp in lps]).sum().backward()
    else:
        with torch.no_grad():
            token_logprobs(model, prompts, completions)
    synchronize()
    seconds = time.perf_counter() - start
    return sum(len(p) + len(c) for p, c in zip(prompts, completions)) / seconds


def paired(name: str, runs: dict[str, callable], rounds: int) -> None:
    (a, run_a), (b, run_b) = runs.items()
    rates: dict[str, list[float]] = {a: [], b: []}
    with OtherLoad() as load:
        for r in range(rounds):
            for which in (a, b) if r % 2 == 0 else (b, a):
                rates[which].append((run_a if which == a else run_b)())
    ratios = [x / y for x, y in zip(rates[a], rates[b])]
    cores = "?" if load.cores is None else f"{load.cores:.1f}"
    print(
        f"| {name} | {statistics.median(rates[a]):.1f} | {statistics.median(rates[b]):.1f} "
        f"| {statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] | {cores} |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sequences", type=int, default=16, help="trainer batch")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 rounds")
    p.add_argument("--skip-serving", action="store_true", help="the trainer side only")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.rounds = "tiny", 2
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    flags = {f for f in _cpu_id().split() if f.startswith(("avx", "amx", "fma"))}
    gpu = f", GPU: {torch.cuda.get_device_name()}" if args.device == "cuda" else ""
    print(f"# {args.preset} {args.dtype}, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"CPU flags: {' '.join(sorted(flags))}{gpu}")  # fmt: skip
    print("| measure | A tok/s (median) | B tok/s (median) | A/B per round: median [min, max] | other cores |")
    print("|---|---|---|---|---|")
    rng = random.Random(0)
    if not args.skip_serving:
        engines = {inv: make_engine(model_dir, inv, args.dtype, args.device) for inv in (False, True)}
        for engine in engines.values():
            run_engine(engine, (1, 16, 2, 4), rng)  # warm-up: kernels built, weights packed
        paired(
            "serving `batch` (A invariant, B default)",
            {"invariant": lambda: run_engine(engines[True], WORKLOADS["batch"], rng),
             "default": lambda: run_engine(engines[False], WORKLOADS["batch"], rng)},
            args.rounds,
        )  # fmt: skip
        del engines
    dtype = getattr(torch, args.dtype)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device)
    exact = patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(args.device))
    prompts, completions = trainer_batch(plain.config.vocab_size, rng, args.sequences)
    for model in (plain, exact):
        time_trainer(model, prompts[:2], completions[:2], True)  # warm-up
    for backward in (True, False):
        paired(
            f"trainer {'forward + backward' if backward else 'forward'} (A patched, B unpatched)",
            {"patched": lambda b=backward: time_trainer(exact, prompts, completions, b),
             "unpatched": lambda b=backward: time_trainer(plain, prompts, completions, b)},
            args.rounds,
        )  # fmt: skip


if __name__ == "__main__":
    main()
