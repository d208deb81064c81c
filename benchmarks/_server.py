"""Start `rlserve serve` in its own process for a benchmark and hand back its URL."""

from __future__ import annotations

import contextlib
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Server:
    url: str
    pid: int
    admin_url: str | None = None  # a deployment's admin address

    def pids(self) -> list[int]:
        """The server and every process under it (a deployment's replicas and router; Linux /proc)."""
        children: dict[int, list[int]] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
        out, todo = [self.pid], [self.pid]
        while todo:
            kids = children.get(todo.pop(), [])
            out += kids
            todo += kids
        return out


@contextlib.contextmanager
def rlserve_server(*args: str, timeout: float = 300.0) -> Iterator[Server]:
    """Its output goes to a file, not a pipe nobody reads (a full pipe would stall the server)."""
    with tempfile.NamedTemporaryFile("w+b", prefix="rlserve-bench-", suffix=".log") as log:
        cmd = [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                text = Path(log.name).read_text(errors="replace")
                match = re.search(r"^rlserve: serving \S+ on (http://[^\s)]+)(?:.*admin: (http://[^\s)]+))?", text, re.M)
                if match:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{text}")
                time.sleep(0.2)
            yield Server(match.group(1), proc.pid, match.group(2))
        finally:
            proc.terminate()
            proc.wait(timeout=60)
