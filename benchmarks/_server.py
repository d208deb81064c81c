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
                match = re.search(r"rlserve: serving \S+ on (http://\S+)", text)
                if match:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{text}")
                time.sleep(0.2)
            while not _healthy(match.group(1)):  # the URL is printed just before uvicorn listens
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not become healthy:\n{Path(log.name).read_text(errors='replace')}")
                time.sleep(0.1)
            yield Server(match.group(1), proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def _healthy(url: str) -> bool:
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
