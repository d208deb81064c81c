"""A decode step's attention through the kernels' paged attention, against the same kernel built from
another git revision, in one process.

The shape is a SmolLM2-135M decode step's (9 query heads over 3 KV heads of 64, 16-token blocks): `--rows`
decode rows of `--context` to `--context` + 15 positions, their blocks spread at random over a pool, and
30 layers, each with its own K and V, so every call reads its KV from memory as a decode step does (the
GEMMs between two layers' attention evict it); `--hot` reuses one layer's KV (it stays in the caches)
to show what the memory costs. Each build runs in turn, alternating with the other, best of
`--repeats`; the two builds' outputs must be bitwise equal. Prints the CPU's flags, ms per step's 30
layers, the KV read in GB/s and the ratio.

    python benchmarks/attention.py --against HEAD~1                   # bf16 and fp32, 64 rows of ~100
    python benchmarks/attention.py --against HEAD~1 --rows 1 16 64 --context 100 1000 --threads 1 2
"""

from __future__ import annotations

import argparse
import ctypes
import tempfile
import time
from pathlib import Path

import torch

from _revision import build_at
from rlserve.bench.machine import cpu_info, describe
from rlserve.model.cpu_kernels import CpuKernels, _build, _compiler

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def compare(libs: dict[str, CpuKernels], dtype: torch.dtype, rows: int, context: int, threads: int, args) -> dict:
    gen = torch.Generator().manual_seed(0)
    layers = 1 if args.hot else args.layers
    lens = torch.tensor([context + i % 16 for i in range(rows)], dtype=torch.long)
    width = -(-int(lens.max()) // BLOCK)
    pool_blocks = rows * width + 64
    kv = torch.randn(layers, 2, pool_blocks * BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    blocks = torch.randperm(pool_blocks, generator=gen)[: rows * width].view(rows, width).contiguous()
    q = torch.randn(rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    calls = [kv[i % layers] for i in range(args.layers)]
    read = int(lens.sum()) * KV_HEADS * HEAD_DIM * kv.element_size() * 2 * args.layers
    best, first = dict.fromkeys(libs, float("inf")), {}
    torch.set_num_threads(threads)  # the kernels take their thread count from torch
    for _ in range(args.repeats):
        for name, lib in libs.items():
            start = time.perf_counter()
            outs = [lib.attention(q, k, v, blocks, lens, BLOCK, HEAD_DIM**-0.5) for k, v in calls]
            best[name] = min(best[name], time.perf_counter() - start)
            first.setdefault(name, outs)
    ref = next(iter(first.values()))
    for name, outs in first.items():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs)), f"{name}'s attention gave other bits"
    return {name: (took, read / took / 1e9) for name, took in best.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="REV", help="a git revision whose kernels to build and alternate with")
    p.add_argument("--dtype", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    p.add_argument("--rows", nargs="+", type=int, default=[64])
    p.add_argument("--context", nargs="+", type=int, default=[100], help="each row's positions, +0 to +15")
    p.add_argument("--threads", nargs="+", type=int, default=[2])
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--hot", action="store_true", help="one layer's KV for every layer: in the caches")
    args = p.parse_args(argv)
    print(describe(cpu_info()))
    threads_before = torch.get_num_threads()
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": CpuKernels(ctypes.CDLL(str(_build(_compiler()))))}
        if args.against:
            libs[args.against] = CpuKernels(ctypes.CDLL(str(build_at(args.against, Path(tmp)))))
        print(f"{'dtype':9} {'rows':>4} {'ctx':>5} {'thr':>3}  " + "  ".join(f"{n:>22}" for n in libs) + "  ratio")
        for dtype in args.dtype:
            for rows in args.rows:
                for context in args.context:
                    for threads in args.threads:
                        got = compare(libs, DTYPES[dtype], rows, context, threads, args)
                        cells = "  ".join(f"{ms * 1e3:8.2f} ms {gbs:5.1f} GB/s" for ms, gbs in got.values())
                        ratio = f"  {got[args.against][0] / got['this tree'][0]:.3f}x" if args.against else ""
                        print(f"{dtype:9} {rows:4} {context:5} {threads:3}  {cells}{ratio}", flush=True)
    torch.set_num_threads(threads_before)


if __name__ == "__main__":
    main()
