"""How many CPU cores processes outside a benchmark used while it ran (Linux; None elsewhere).

Well above 0 means the run shared the machine and its figures are low: with every core busy, a
descheduled thread stalls each parallel region it belongs to."""

from __future__ import annotations

import os
import time


def _machine_busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _process_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _with_descendants(pids) -> list[int]:
    out, todo = [], list(pids)
    while todo:
        pid = todo.pop()
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
    than this one and `pids` used on average during the block."""

    def __init__(self, *pids: int):
        self.pids, self.cores = pids, None

    def _ours(self) -> float:
        # a server's engine core processes (its children) are part of the run too
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


def instruction_peaks() -> tuple[float, float] | None:
    """One core's fp32 FMA and bf16 dot-product peaks in GFLOP/s (_peak.c), or None where there is
    no C compiler or no AVX512_BF16. Their ratio caps bf16's gain over an fp32 path that runs at
    its own peak."""
    import subprocess
    import tempfile
    from pathlib import Path

    from rlserve.model.cpu_kernels import _compiler, cpu_has_native_bf16

    cc = _compiler()  # the one the C kernels are built with
    if cc is None or not cpu_has_native_bf16():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "peak"
        built = subprocess.run(
            [cc, "-O2", str(Path(__file__).with_name("_peak.c")), "-o", str(exe)], capture_output=True, timeout=120
        )
        if built.returncode != 0:
            return None  # an AMX-only or non-x86 CPU, or a compiler without the intrinsics
        fp32, bf16 = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return float(fp32), float(bf16)
