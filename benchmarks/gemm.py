"""A decode step's projections and LM head through the kernels' packed GEMM, against the same GEMM built
from another git revision, in one process.

The weights are a SmolLM2-135M-shaped model's (30 layers of QKV, O, gate-up and down, and the LM head,
~480 MB in fp32), each its own tensor, so every call streams its weight from memory as a decode step
does; `--hot` reuses one layer's weights (they stay in the caches) to show what the memory costs. Each
build runs every shape in turn, alternating with the other build, best of `--repeats`; the outputs of
the two builds must be bitwise equal. Prints the CPU's flags, ms per pass, GFLOP/s and the ratio.

    python benchmarks/gemm.py --against HEAD~1                  # fp32, 64 rows, 2 threads
    python benchmarks/gemm.py --against HEAD~1 --dtype float32 bfloat16 --rows 32 64 128 --threads 1 2
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
LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [N, K]: QKV, O, gate-up, down
HEAD = (49152, 576)


def one_pass(lib: CpuKernels, weights, packed, xs, threads: int) -> tuple[float, list[torch.Tensor]]:
    start, outs = time.perf_counter(), []
    for w, p in zip(weights, packed):
        outs.append(lib.gemv(xs[w.shape[1]], w, threads=threads, packed=p, fp32_out=w.shape == HEAD))
    return time.perf_counter() - start, outs


def compare(libs: dict[str, CpuKernels], dtype: torch.dtype, rows: int, threads: int, hot: bool, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    layers = 1 if hot else 30
    weights = [(torch.randn(n, k, generator=gen) * 0.05).to(dtype) for n, k in LAYER * layers + [HEAD]]
    # the call order: 30 layers' projections (hot: the one layer's, 30 times), then the LM head
    order = list(range(len(LAYER) * layers)) * (30 // layers) + [len(weights) - 1]
    calls = [weights[i] for i in order]
    packed = {name: [lib.gemm_pack(w) for w in weights] for name, lib in libs.items()}
    packed = {name: [p[i] for i in order] for name, p in packed.items()}
    xs = {k: torch.randn(rows, k, generator=gen).to(dtype) for k in (576, 1536)}
    flops = sum(2 * rows * w.shape[0] * w.shape[1] for w in calls)
    best, first = dict.fromkeys(libs, float("inf")), {}
    for _ in range(repeats):
        for name, lib in libs.items():
            took, outs = one_pass(lib, calls, packed[name], xs, threads)
            best[name] = min(best[name], took)
            first.setdefault(name, outs)
    ref = next(iter(first.values()))
    for name, outs in first.items():
        assert all(torch.equal(a, b) for a, b in zip(ref, outs)), f"{name}'s GEMM gave other bits"
    return {name: (took, flops / took / 1e9) for name, took in best.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--against", metavar="REV", help="a git revision whose kernels to build and alternate with")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=list(DTYPES))
    p.add_argument("--rows", nargs="+", type=int, default=[64])
    p.add_argument("--threads", nargs="+", type=int, default=[2])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--hot", action="store_true", help="one layer's weights for all 30 layers: in the caches")
    args = p.parse_args(argv)
    print(describe(cpu_info()))
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"this tree": CpuKernels(ctypes.CDLL(str(_build(_compiler()))))}
        if args.against:
            libs[args.against] = CpuKernels(ctypes.CDLL(str(build_at(args.against, Path(tmp)))))
        print(f"{'dtype':9} {'rows':>4} {'thr':>3}  " + "  ".join(f"{n:>22}" for n in libs) + "  ratio")
        for dtype in args.dtype:
            for rows in args.rows:
                for threads in args.threads:
                    got = compare(libs, DTYPES[dtype], rows, threads, args.hot, args.repeats)
                    cells = "  ".join(f"{ms * 1e3:8.2f} ms {gf:6.0f} GF/s" for ms, gf in got.values())
                    ratio = f"  {got[args.against][0] / got['this tree'][0]:.3f}x" if args.against else ""
                    print(f"{dtype:9} {rows:4} {threads:3}  {cells}{ratio}", flush=True)


if __name__ == "__main__":
    main()
