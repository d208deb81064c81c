"""rlserve against llama.cpp's `llama-server`, both through HTTP, on the same random-weight model.

Workloads (issue 15): 64 concurrent requests with distinct random 64-token prompts and 64 new
tokens, then batch 1 with 128 new tokens; temperature 1, EOS ignored, non-streaming
/v1/completions with token-id prompts on both servers. Pairs: rlserve fp32 with llama.cpp F32,
rlserve bf16 with llama.cpp BF16. Both servers of a pair are up together and take turns, each workload
--rounds times in alternating order; the ratio quoted is the median of the rounds' ratios (one run each
moved by 30% between runs on this shared machine; the rounds see the same drift).

    python benchmarks/llamacpp.py --build   # once: llama-server from the llama-cpp-python sdist (~1 h on 2 cores)
    python benchmarks/llamacpp.py           # the comparison; llama.cpp rows are skipped when it is not built

llama.cpp is built and its GGUF files written under $RLSERVE_CACHE_DIR/llamacpp, never in the repo.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx

from _cpu import OtherLoad
from _server import Server, add_workload_args, exit_on_sigterm, rlserve_server
from rlserve.bench.llamacpp import GGML_TYPES, build, gguf, server_binary, source_dir
from rlserve.bench.serve import random_prompts, run_level
from rlserve.model.make import bench_cache_dir, make_model
from rlserve.runtime.ports import free_port

PAIRS = list(GGML_TYPES.items())  # F32 with fp32, BF16 with bf16
# the goals: rlserve tok/s over llama.cpp's, per precision pair and workload
TARGETS = {("float32", "64 concurrent"): 1.0, ("float32", "batch 1"): 1.0,
           ("bfloat16", "64 concurrent"): 1.5, ("bfloat16", "batch 1"): 1.0}  # fmt: skip


def llama_server_binary() -> Path | None:
    return server_binary()[0]


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, args) -> Iterator[Server]:
    port = free_port()
    ctx = args.clients * (args.prompt_len + max(args.new_tokens, args.single_new_tokens) + 16)
    cmd = [str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", str(args.clients),
           "-t", str(args.threads), "-c", str(ctx)]  # fmt: skip
    exit_on_sigterm()
    with tempfile.NamedTemporaryFile("w+b", prefix="llama-server-", suffix=".log") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server did not start:\n{Path(log.name).read_text(errors='replace')}")
                time.sleep(0.3)
            yield Server(url, proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


WORKLOADS = ("64 concurrent", "batch 1")


def warm_up(server: Server, args, seed: int) -> None:
    opts = SimpleNamespace(model=None, output_len=8, temperature=1.0, no_stream=True, no_progress=True, timeout=1800.0)
    asyncio.run(run_level(server.url, 1, random_prompts(1, args.prompt_len, args.vocab, seed), opts))


def measure(server: Server, args, name: str, seed: int) -> tuple[float, float | None]:
    """tok/s of one workload against one server, and other processes' CPU use meanwhile (not the server's, nor
    the clients'; an idle peer server counts, so a busy one would show)."""
    clients, new_tokens = (args.clients, args.new_tokens) if name == "64 concurrent" else (1, args.single_new_tokens)
    opts = SimpleNamespace(
        model=None, output_len=new_tokens, temperature=1.0, no_stream=True, no_progress=True, timeout=1800.0
    )
    prompts = random_prompts(clients, args.prompt_len, args.vocab, seed)
    with OtherLoad(*server.pids()) as load:
        run = asyncio.run(run_level(server.url, clients, prompts, opts))
    if run["failed"]:
        raise RuntimeError(f"{run['failed']} requests failed: {run['errors']}")
    return run["output_tokens_per_s"], load.cores


def rounds(ours: Server, peer: Server | None, args, seed: int) -> dict[str, dict[str, list]]:
    """Each workload `args.rounds` times on both servers, the order alternating (ABBA...), so that the machine's
    drift (its memory bandwidth moved 25-36 GB/s between runs here) lands on both: per workload, each system's
    (tok/s, others) per round."""
    got: dict[str, dict[str, list]] = {name: {"ours": [], "peer": []} for name in WORKLOADS}
    for r in range(args.rounds):
        for i, name in enumerate(WORKLOADS):
            order = [("ours", ours), ("peer", peer)] if (r + i) % 2 == 0 else [("peer", peer), ("ours", ours)]
            for who, server in order:
                if server is not None:  # the same prompts for both in a round, new ones the next
                    got[name][who].append(measure(server, args, name, seed + 10 * r + i))
    return got


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", action="store_true", help="build llama-server into the cache and exit")
    add_workload_args(p)
    p.add_argument("--single-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--rounds", type=int, default=3, help="each workload this many times per server, alternating")
    p.add_argument("--dtype", nargs="+", choices=[d for d, _ in PAIRS], default=[d for d, _ in PAIRS])
    args = p.parse_args(argv)
    if args.build:
        build()
        return
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    args.vocab = 1000
    binary = llama_server_binary()
    print(
        f"model {args.preset} (random weights) at {model_dir}; {args.clients} concurrent x {args.prompt_len} + "
        f"{args.new_tokens} tokens, batch 1 x {args.single_new_tokens}; temperature 1, EOS ignored, via HTTP"
    )
    if binary is None or source_dir() is None:
        print("llama.cpp: skipped (no llama-server; run `python benchmarks/llamacpp.py --build` or set LLAMA_SERVER)")
    rows = []
    for seed, (dtype, ggml_type) in enumerate(PAIRS, start=1):
        if dtype not in args.dtype:
            continue
        kv = (
            args.clients
            * (args.prompt_len + args.single_new_tokens + 32)
            * 30
            * 2
            * 3
            * 64
            * (4 if dtype == "float32" else 2)
        )
        server_args = ["--model.name", str(model_dir), "--model.dtype", dtype, "--model.max_model_len", "512",
                       "--engine.kv_cache_bytes", str(kv), "--num_threads", str(args.threads)]  # fmt: skip
        with contextlib.ExitStack() as stack:
            ours = stack.enter_context(rlserve_server(*server_args))
            peer = None
            if binary is not None and source_dir() is not None:
                peer = stack.enter_context(llama_server(binary, gguf(model_dir, dtype), args))
            for server in (ours, peer):
                if server is not None:
                    warm_up(server, args, seed * 100 - 1)
            got = rounds(ours, peer, args, seed * 100)
        for name in WORKLOADS:
            mine = got[name]["ours"]
            rows.append((f"rlserve {dtype}", name, mine, None))
            if got[name]["peer"]:
                theirs = got[name]["peer"]
                ratios = sorted(a[0] / b[0] for a, b in zip(mine, theirs))
                ratio, goal = statistics.median(ratios), TARGETS[(dtype, name)]
                rows.append(
                    (
                        f"llama.cpp {ggml_type}",
                        name,
                        theirs,
                        f"{ratio:.2f}x, rounds sorted {', '.join(f'{x:.2f}' for x in ratios)} "
                        f"(>= {goal}x: {'met' if ratio >= goal else 'missed'})",
                    )
                )
    print(
        f"\n{'server':<18} {'workload':<14} {'tok/s':>8} {'per round':<22} {'others':>7}  rlserve/x (median of rounds)"
    )
    for system, name, runs, ratio in rows:
        rates = [tok_s for tok_s, _ in runs]
        others = [o for _, o in runs if o is not None]
        print(
            f"{system:<18} {name:<14} {statistics.median(rates):>8.1f} {', '.join(f'{x:.1f}' for x in rates):<22} "
            f"{f'{max(others):.2f}' if others else '':>7}  {ratio or ''}"
        )
    print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


if __name__ == "__main__":
    main()
