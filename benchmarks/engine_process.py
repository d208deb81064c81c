"""The engine core in its own process against the in-thread engine, and data parallelism, in one run.

Same workload as serving.py (C clients, random P-token prompts, N new tokens, temperature 1, EOS
ignored), as a fraction of the offline engine's tok/s measured in the same run:
  - server, engine core process (the default), streaming and not
  - server, engine in a thread of the HTTP process (engine.core_process=false), streaming and not
  each twice: with the engine on every core (the default), and with the engine (offline too) on
  one core fewer, which leaves a core to the HTTP process and the clients. The clients run on this
  machine, so with every core given to the engine they and the HTTP process preempt its threads:
  each preemption stalls a whole parallel region, so a little CPU taken costs a lot of throughput.
  The second layout is the one that shows what the HTTP layer itself costs the engine (vLLM's CPU
  backend reserves cores for its API server for the same reason).
  - tp=1 x 2 threads (one engine, the default) vs tp=2 x 1 thread (two tensor-parallel ranks of
    one engine) vs dp=2 x 1 thread (two engine processes), streaming, as ratios to tp=1.
    SmolLM2-135M's 9 heads / 3 KV heads do not split two ways, so these three rows serve the same
    weights read as twice as many heads of half the size (18 x 32, 6 KV heads: identical tensors
    and projection FLOPs per token).

    python benchmarks/engine_process.py [--preset smollm2-135m] [--clients 64] [--parallel-only]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from _server import add_workload_args, served
from rlserve.model.make import bench_cache_dir, make_model
from serving import offline, workload


def splittable(model_dir: Path, tp: int) -> Path:
    """`model_dir` itself when its heads split `tp` ways; else the same weights read as heads of a
    size that splits (same q/k/v widths, so the same tensors and FLOPs): a sibling directory whose
    config.json differs and whose other files link to the original's."""
    cfg = json.loads((model_dir / "config.json").read_text())
    heads, kv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    if heads % tp == 0 and kv % tp == 0:
        return model_dir
    scale = next(s for s in range(2, hd) if hd % s == 0 and kv * s % tp == 0 and heads * s % tp == 0)
    out = model_dir.with_name(f"{model_dir.name}-tp{tp}")
    out.mkdir(exist_ok=True)
    for f in model_dir.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f)
    cfg |= {"num_attention_heads": heads * scale, "num_key_value_heads": kv * scale, "head_dim": hd // scale}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def parallel_rows(model_dir: Path, prompts, args, cores: int) -> list[tuple[str, float, float | None]]:
    """One engine with all the cores vs two tensor-parallel ranks vs two data-parallel engines."""
    split = splittable(model_dir, 2)
    shape = json.loads((split / "config.json").read_text())
    note = "" if split == model_dir else f" ({shape['num_attention_heads']}x{shape['head_dim']} heads)"
    return [
        (f"tp=1 x {cores} threads{note}, stream", *served(split, prompts, args, True)),
        (f"tp=2 x {cores // 2} thread{note}, stream", *served(split, prompts, args, True, "--parallel.tp", "2")),
        (f"dp=2 x {cores // 2} thread{note}, stream", *served(split, prompts, args, True, "--parallel.dp", "2")),
    ]


def process_rows(model_dir: Path, prompts, args, threads: int) -> tuple[int, list[tuple[str, float, float | None]]]:
    """Offline, then served by the engine core process and by the in-thread engine, each engine on `threads`."""
    t = ("--num_threads", str(threads))
    in_thread = ("--engine.core_process", "false")
    return threads, [
        ("rlserve engine, offline", *offline(model_dir, prompts, args, threads)),
        ("server, core process, stream", *served(model_dir, prompts, args, True, *t)),
        ("server, core process, no stream", *served(model_dir, prompts, args, False, *t)),
        ("server, in-thread, stream", *served(model_dir, prompts, args, True, *t, *in_thread)),
        ("server, in-thread, no stream", *served(model_dir, prompts, args, False, *t, *in_thread)),
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--parallel-only", action="store_true", help="only the tp/dp rows")
    args = p.parse_args()
    cores = os.cpu_count() or 1
    torch.set_num_threads(cores)
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    from transformers import AutoConfig

    prompts = workload(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    sections = (
        []
        if args.parallel_only
        else [process_rows(model_dir, prompts, args, n) for n in sorted({cores, max(1, cores - 1)}, reverse=True)]
    )
    parallel = parallel_rows(model_dir, prompts, args, cores) if cores >= 2 else []
    print(
        f"\nengine process, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + "
        f"{args.new_tokens} new tokens), {cores} cores"
    )
    for threads, rows in sections:
        print(f"\nengine on {threads} of {cores} cores{' (offline too)' if threads < cores else ''}")
        print(f"{'system':34s} {'tok/s':>8s} {'/offline':>9s} {'others':>7s}")
        for name, tps, others in rows:
            print(f"{name:34s} {tps:8.1f} {tps / rows[0][1]:9.1%} {'-' if others is None else f'{others:.2f}':>7s}")
    if parallel:
        print(f"\n{'parallel layout':44s} {'tok/s':>8s} {'/tp=1':>7s} {'others':>7s}")
        for name, tps, others in parallel:
            print(f"{name:44s} {tps:8.1f} {tps / parallel[0][1]:7.2f} {'-' if others is None else f'{others:.2f}':>7s}")
    print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


if __name__ == "__main__":
    main()
