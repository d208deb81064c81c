"""The machine a benchmark ran on: the CPU's model and the flags that decide kernel paths (AVX2,
AVX-512, native bf16); how many cores processes outside the benchmark used while it ran (Linux
/proc; None elsewhere), well above 0 meaning the run shared the machine and its figures are low
(with every core busy, a descheduled thread stalls each parallel region it belongs to); and a wait
for those processes to go quiet before a timed run."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

from rlserve.model.cpu_kernels import cpu_has_native_bf16

FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "avx512_fp16",
                     "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "bf16")  # fmt: skip


def cpu_info() -> dict:
    """JSON-ready: model name, cores this process may use, the flags above that the CPU has, native bf16."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = {f for ln in lines if ln.startswith(("flags", "Features")) for f in ln.split(":", 1)[1].split()}
    names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return {
        "model": names[0] if names else platform.processor() or platform.machine(),
        "cores": cores,
        "flags": [f for f in FLAGS_OF_INTEREST if f in flags],
        "native_bf16": cpu_has_native_bf16(),
    }


def describe(cpu: dict) -> str:
    bf16 = "native bf16" if cpu["native_bf16"] else "no native bf16 (bf16 is emulated: its targets are not applied)"
    return f"CPU: {cpu['model']}, {cpu['cores']} cores; flags: {' '.join(cpu['flags']) or '-'}; {bf16}"


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _process_seconds(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except OSError:
        return 0.0  # exited meanwhile
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _with_descendants(pids) -> list[int]:
    """pids and every process below them, each once (a listed child is also its parent's descendant)"""
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


class OtherLoad:
    """`with OtherLoad(server_pid) as load: ...` then `load.cores`: the cores that processes other
    than this one and `pids` (with their descendants) used on average during the block."""

    def __init__(self, *pids: int):
        self.pids, self.cores = pids, None

    def _ours(self) -> float:
        return time.process_time() + sum(_process_seconds(p) for p in _with_descendants(self.pids))

    def __enter__(self) -> OtherLoad:
        busy = _machine_busy_seconds()  # None off Linux: no /proc to read the pids' time from either
        self._start = None if busy is None else (busy, self._ours(), time.perf_counter())
        return self

    def __exit__(self, *exc) -> None:
        if self._start is not None:
            busy, ours, wall = _machine_busy_seconds(), self._ours(), time.perf_counter()
            others = (busy - self._start[0]) - (ours - self._start[1])
            self.cores = max(0.0, others) / (wall - self._start[2])


def wait_quiet(below: float = 0.1, window: float = 0.5, limit: float = 20.0) -> tuple[bool, float]:
    """Wait until processes other than this one use fewer than `below` cores over `window` seconds,
    at most `limit` seconds. Returns (quiet, seconds waited); (True, 0.0) off Linux. A server's
    threads can spin on after its last request (vLLM's worker holds a core for about a second),
    so a run that starts at once measures the next server on a shared machine."""
    if _machine_busy_seconds() is None:
        return True, 0.0
    start = time.perf_counter()
    while True:
        with OtherLoad() as load:  # no pids: everything but this process
            time.sleep(window)
        waited = time.perf_counter() - start
        if load.cores < below:
            return True, waited
        if waited >= limit:
            return False, waited
