"""bench/machine.py on real processes: whose CPU time a benchmark's "others" counts, and the wait for
the machine to go quiet before a timed run (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlserve.bench.machine import _with_descendants, wait_quiet

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux /proc")

SPIN = "while True: pass"
PARENT = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(300)'])"


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def test_a_child_listed_beside_its_parent_is_counted_once():
    # A server's recorded pids hold its engine too: counted twice, its CPU time hid as much of
    # other processes' time, and a peer spinning beside rlserve showed as 0.00 cores.
    parent = subprocess.Popen([sys.executable, "-c", PARENT])
    try:
        deadline = time.monotonic() + 60
        while not _children(parent.pid):
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child = _children(parent.pid)[0]
        got = _with_descendants([parent.pid, child])
        assert sorted(got) == sorted({parent.pid, child})
    finally:
        for pid in [*_children(parent.pid), parent.pid]:
            os.kill(pid, 9)
        parent.wait()


def test_the_wait_for_quiet_gives_up_on_a_process_that_keeps_spinning():
    spinner = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        quiet, waited = wait_quiet(below=0.1, window=0.25, limit=1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert not quiet and waited >= 1.0


def test_the_wait_for_quiet_returns_once_the_others_are_under_the_bar():
    quiet, waited = wait_quiet(below=(os.cpu_count() or 1) + 1.0, window=0.1, limit=30.0)
    assert quiet and waited < 30.0
