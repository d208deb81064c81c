"""deploy/process.py's Child: a frozen child (SIGSTOP, as a replica the supervisor restarts for not answering)
is stopped by its own SIGTERM handler, not by the SIGKILL that ends the grace period."""

from __future__ import annotations

import os
import signal
import sys
import threading

from rlserve.deploy.process import Child

# installs its SIGTERM handler, says so, then waits; the handler says goodbye and exits 0
SCRIPT = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: (print("goodbye", flush=True), sys.exit(0)))
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_a_frozen_child_handles_its_sigterm_before_the_grace_period_ends():
    lines, ready = [], threading.Event()

    def seen(line: str) -> None:
        lines.append(line)
        if line == "ready":
            ready.set()

    child = Child("frozen", [sys.executable, "-c", SCRIPT], on_line=seen)
    try:
        assert ready.wait(60), lines
        os.kill(child.pid, signal.SIGSTOP)
        child.stop(grace_s=120)  # frozen through it, the child would be SIGKILLed after 120 s (exit code -9)
        assert child.exited() == 0
        assert "goodbye" in lines  # stop() joined the line pump: every line is in
    finally:
        child.stop(grace_s=0)
