"""How long `rlserve serve` takes to answer its first completion, and the CPU its processes spend getting
there and stopping, with the engine core forked from the server (engine.core_start = "fork", the default)
or spawned as a fresh interpreter ("spawn"), and with --tp its workers the same way. The two alternate,
round by round, on the same model.

    python benchmarks/server_start.py --rounds 5            # the embedded default model
    python benchmarks/server_start.py --model /path/to/model
    python benchmarks/server_start.py --tp 2                # and the core's tensor-parallel worker
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import httpx

from _server import rlserve_server
from rlserve.bench.machine import cpu_info, describe


def children_cpu_s() -> float:
    """CPU seconds of every reaped descendant: the server waits for its engine, this process for the server."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def start_once(mode: str, model: list[str]) -> tuple[float, float]:
    """(seconds from the command to its first completion, CPU seconds of the server and its engine)."""
    cpu, started = children_cpu_s(), time.monotonic()
    with rlserve_server("--engine.core_start", mode, "--server.log_level", "warning", *model) as server:
        answer = httpx.post(f"{server.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60)
        answer.raise_for_status()
        ready = time.monotonic() - started
    return ready, children_cpu_s() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model", help="a model directory or hub id (default: the embedded model)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (workers forked or spawned too)")
    args = p.parse_args()
    model = ["--model.name", args.model] if args.model else []
    if args.tp > 1:
        model += ["--parallel.tp", str(args.tp)]
    print(describe(cpu_info()))
    runs: dict[str, list[tuple[float, float]]] = {"fork": [], "spawn": []}
    for _ in range(args.rounds):
        for mode in runs:
            runs[mode].append(start_once(mode, model))
    print(f"{'core_start':<12}{'first answer s (median)':>26}{'CPU s (median)':>17}")
    medians = {}
    for mode, rows in runs.items():
        medians[mode] = (statistics.median(r for r, _ in rows), statistics.median(c for _, c in rows))
        print(f"{mode:<12}{medians[mode][0]:>26.2f}{medians[mode][1]:>17.2f}")
    (fork_s, fork_cpu), (spawn_s, spawn_cpu) = medians["fork"], medians["spawn"]
    print(f"fork/spawn: first answer {fork_s / spawn_s:.2f}x the time, {fork_cpu / spawn_cpu:.2f}x the CPU")


if __name__ == "__main__":
    main()
