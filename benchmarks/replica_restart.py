"""How long a deployment of N local replicas takes to answer through its router, and a replica killed with
SIGKILL to serve again, with its replicas forked from the preloaded process (deployment.fork_replicas = true,
the default) or exec'd afresh (false); also the CPU each replica's server process has used once it serves
again (its engine excluded). The two alternate, round by round, on the same model.

    python benchmarks/replica_restart.py --rounds 3            # the embedded default model, 2 replicas
    python benchmarks/replica_restart.py --replicas 3 --model /path/to/model
    python benchmarks/replica_restart.py --modes forked      # one of the two
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time
from pathlib import Path

import httpx

from _server import rlserve_server
from rlserve.bench.machine import cpu_info, describe

TICK_S = os.sysconf("SC_CLK_TCK")
MODES = {"forked": True, "exec'd": False}  # deployment.fork_replicas


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK_S  # utime, stime


def replicas(admin: str) -> list[dict]:
    return httpx.get(f"{admin}/deployment", timeout=30).json()["replicas"]


def once(fork: bool, replica_count: int, model: list[str]) -> tuple[float, float, float]:
    """(seconds from the command to an answer through the router, seconds from a replica's SIGKILL to it serving
    again, its new server process's CPU seconds by then)."""
    started = time.monotonic()
    args = ("--deployment.replicas", str(replica_count), "--deployment.fork_replicas", str(fork).lower())
    with rlserve_server(*args, "--server.log_level", "warning", *model) as dep:
        assert dep.admin_url is not None
        httpx.post(f"{dep.url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=60).raise_for_status()
        ready = time.monotonic() - started
        victim = replicas(dep.admin_url)[0]
        killed = time.monotonic()
        os.kill(victim["pid"], signal.SIGKILL)
        while True:
            row = replicas(dep.admin_url)[0]
            if row["status"] == "serving" and row["restarts"] == victim["restarts"] + 1:
                return ready, time.monotonic() - killed, cpu_s(row["pid"])
            if time.monotonic() - killed > 300:
                raise RuntimeError(f"replica 0 did not serve again within 300 s: {row}")
            time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--model", help="a model directory or hub id (default: the embedded model)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = p.parse_args()
    model = ["--model.name", args.model] if args.model else []
    print(describe(cpu_info()))
    runs: dict[bool, list[tuple[float, float, float]]] = {MODES[m]: [] for m in args.modes}
    for _ in range(args.rounds):
        for fork in runs:
            runs[fork].append(once(fork, args.replicas, model))
    print(f"{args.replicas} replicas  {'first answer s':>15}{'restart s':>11}{'restarted server CPU s':>24}  (medians)")
    medians = {}
    for fork, rows in runs.items():
        medians[fork] = [statistics.median(r[i] for r in rows) for i in range(3)]
        name = "forked" if fork else "exec'd"
        print(f"{name:<12}{medians[fork][0]:>15.2f}{medians[fork][1]:>11.2f}{medians[fork][2]:>24.2f}")
    if len(medians) == 2:
        f, e = medians[True], medians[False]
        print(
            f"forked/exec'd: first answer {f[0] / e[0]:.2f}x, restart {f[1] / e[1]:.2f}x, server CPU {f[2] / e[2]:.2f}x"
        )


if __name__ == "__main__":
    main()
