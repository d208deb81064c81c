"""The engine core in its own process against the in-thread engine, and data parallelism, in one run.

Same workload as serving.py (C clients, random P-token prompts, N new tokens, temperature 1, EOS
ignored), as a fraction of the offline engine's tok/s measured in the same run:
  - server, engine core process (the default), streaming and not
  - server, engine in a thread of the HTTP process (engine.core_process=false), streaming and not
  - tp=1 x 2 threads (one engine, the default) vs dp=2 x 1 thread (two engine processes)
  (tp=2 x 1 thread is listed as not run: tensor parallelism is not implemented yet)

    python benchmarks/engine_process.py [--preset smollm2-135m] [--clients 64]
"""

from __future__ import annotations

import argparse
import os

import torch

from _server import served
from rlserve.model.make import bench_cache_dir, make_model
from serving import offline, workload


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    args = p.parse_args()
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    from transformers import AutoConfig

    prompts = workload(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    rows = [("rlserve engine, offline", *offline(model_dir, prompts, args))]
    rows.append(("server, core process, stream", *served(model_dir, prompts, args, True)))
    rows.append(("server, core process, no stream", *served(model_dir, prompts, args, False)))
    rows.append(("server, in-thread, stream", *served(model_dir, prompts, args, True, "--engine.core_process", "false")))
    rows.append(("server, in-thread, no stream",
                 *served(model_dir, prompts, args, False, "--engine.core_process", "false")))
    if cores >= 2:
        rows.append((f"tp=1 x {cores} threads, stream", rows[1][1], rows[1][2]))
        rows.append((f"dp=2 x {cores // 2} threads, stream",
                     *served(model_dir, prompts, args, True, "--parallel.dp", "2")))
    print(f"\nengine process, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens), {cores} cores")
    print(f"{'system':34s} {'tok/s':>8s} {'/offline':>9s} {'others':>7s}")
    base = rows[0][1]
    for name, tps, others in rows:
        print(f"{name:34s} {tps:8.1f} {tps / base:9.1%} {'-' if others is None else f'{others:.2f}':>7s}")
    print(f"{'tp=2 x 1 thread':34s} {'not run: tensor parallelism is not implemented yet':>s}")
    print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


if __name__ == "__main__":
    main()
