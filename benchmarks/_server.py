"""Start `rlserve serve` in its own process for a benchmark and hand back its URL; drive C concurrent
clients against it (the served half of serving.py and engine_process.py)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from _cpu import OtherLoad


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


def exit_on_sigterm() -> None:
    """SIGTERM to a benchmark unwinds it like Ctrl-C would, so the servers it started are stopped in
    their `finally` blocks instead of being left running (the default action skips them)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


@contextlib.contextmanager
def rlserve_server(*args: str, timeout: float = 300.0) -> Iterator[Server]:
    """Its output goes to a file, not a pipe nobody reads (a full pipe would stall the server)."""
    exit_on_sigterm()
    with tempfile.NamedTemporaryFile("w+b", prefix="rlserve-bench-", suffix=".log") as log:
        cmd = [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", *args]
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + timeout
            while True:
                text = Path(log.name).read_text(errors="replace")
                match = re.search(
                    r"^rlserve: serving \S+ on (http://[^\s)]+)(?:.*admin: (http://[^\s)]+))?", text, re.M
                )
                if match:
                    break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not start:\n{text}")
                time.sleep(0.2)
            while not _healthy(match.group(1)):  # the URL is printed just before uvicorn listens
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"server did not become healthy:\n{Path(log.name).read_text(errors='replace')}")
                time.sleep(0.1)
            yield Server(match.group(1), proc.pid, match.group(2))
        finally:
            proc.terminate()
            proc.wait(timeout=60)


def add_workload_args(
    p: argparse.ArgumentParser, clients: int = 64, prompt_len: int = 64, new_tokens: int = 64
) -> None:
    """The workload flags of a served run: --preset, --clients C, --prompt-len P, --new-tokens N."""
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=clients)
    p.add_argument("--prompt-len", type=int, default=prompt_len)
    p.add_argument("--new-tokens", type=int, default=new_tokens)


def workload_args(model_dir: Path, args: argparse.Namespace) -> tuple[str, ...]:
    """The server settings every served run of a prompt_len + new_tokens workload shares."""
    return (
        "--model.name",
        str(model_dir),
        "--model.max_model_len",
        str(args.prompt_len + args.new_tokens + 16),
        "--server.log_level",
        "warning",
    )


def served(
    model_dir: Path, prompts: list[list[int]], args: argparse.Namespace, stream: bool, *extra: str
) -> tuple[float, float | None]:
    """tok/s of `prompts` sent at once to a fresh server, and the cores other processes used meanwhile."""
    with rlserve_server(*workload_args(model_dir, args), *extra) as server:
        return asyncio.run(clients(server.url, server.pids(), prompts, args.new_tokens, stream))


async def clients(
    url: str, server_pids: list[int], prompts: list[list[int]], new_tokens: int, stream: bool
) -> tuple[float, float | None]:
    body = {
        "max_tokens": new_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": stream,
        "return_token_ids": True,
    }
    limits = httpx.Limits(max_connections=len(prompts) + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await client.post("/v1/completions", json={**body, "prompt": prompts[0], "max_tokens": 2, "stream": False})

        async def one(prompt: list[int]) -> int:
            if not stream:
                r = await client.post("/v1/completions", json={**body, "prompt": prompt})
                return len(r.json()["choices"][0]["token_ids"])
            count = 0
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices", []):
                            count += len(choice.get("token_ids") or [])
            return count

        with OtherLoad(*server_pids) as load:  # the clients (this process) and the server(s) are the run
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.perf_counter() - start
        return sum(counts) / elapsed, load.cores


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
