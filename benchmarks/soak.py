"""Soak under faults: N concurrent streaming clients against one `rlserve serve` for M minutes, with one fault
injected every F seconds, rotating through: the engine core killed (SIGKILL), the engine core frozen (SIGSTOP
for a few seconds), a burst of clients disconnecting mid-stream, a burst of bad requests (integers past 64 bits).

This script plays the supervisor a deployment has: when the server exits (code 3 after its engine died,
docs/faults.md) it starts it again, and clients retry after a refused connection. Every request ends as
  served   - a 200 whose stream finished normally,
  failed   - an answer that says why (HTTP status, in-band error, connection refused while restarting),
  lost     - no answer at all within --lost-after seconds (must be 0).
Prints the tally and writes RSS over time (server + engine processes) with the faults marked as a PNG.

    python benchmarks/soak.py --minutes 10 --streams 256 --fault-every 60 --out runs/soak
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

FAULTS = ("engine-kill", "engine-freeze", "disconnect-burst", "bad-input-burst")
HUGE = 2**70


class Supervised:
    """One `rlserve serve` process, started again whenever it exits."""

    def __init__(self, extra: list[str]):
        self.extra, self.restarts, self.proc, self.url = extra, 0, None, None
        self.log = Path(tempfile.mkstemp(prefix="rlserve-soak-", suffix=".log")[1])

    def start(self) -> None:
        port = self.url.rsplit(":", 1)[1] if self.url else "0"  # the same port again: clients keep their URL
        cmd = [
            sys.executable,
            "-m",
            "rlserve.cli",
            "serve",
            "--server.host",
            "127.0.0.1",
            "--server.port",
            port,
            "--engine.kv_cache_bytes",
            str(256 << 20),
            "--model.max_model_len",
            "1024",
            *self.extra,
        ]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        while self.url is None:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith("rlserve: serving ") and " on http" in line:
                    self.url = line.rsplit(" on ", 1)[1].strip()
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: see {self.log}")
            time.sleep(0.2)

    async def wait_healthy(self) -> None:
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                try:
                    if (await client.get(f"{self.url}/health")).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)

    def engine_pid(self) -> int | None:
        try:
            kids = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return None
        return next(
            (p.pid for p in kids if "engine.core" in " ".join(p.cmdline()) or "runtime.core" in " ".join(p.cmdline())),
            None,
        )

    def rss_bytes(self) -> int:
        try:
            root = psutil.Process(self.proc.pid)
            return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        except psutil.NoSuchProcess:
            return 0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Tally:
    def __init__(self):
        self.served, self.lost = 0, 0
        self.failed: collections.Counter[str] = collections.Counter()

    def fail(self, reason: str) -> None:
        self.failed[reason[:90]] += 1


async def one_request(
    client: httpx.AsyncClient, url: str, rng: random.Random, tally: Tally, lost_after: float, cancel: asyncio.Event
) -> None:
    body = {
        "prompt": [rng.randrange(1, 250) for _ in range(rng.randrange(8, 200))],
        "max_tokens": rng.randrange(4, 96),
        "ignore_eos": True,
        "stream": True,
    }

    async def run() -> None:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                tally.fail(f"HTTP {r.status_code}: {_message(r.text)}")
                return
            error = None
            async for line in r.aiter_lines():
                if cancel.is_set():
                    tally.fail("client disconnected on purpose")
                    return
                if line.startswith("data: {") and '"error"' in line:
                    error = _message(line[6:])
            if error is None:
                tally.served += 1
            else:
                tally.fail(f"in-band: {error}")

    try:
        await asyncio.wait_for(run(), lost_after)
    except asyncio.TimeoutError:
        tally.lost += 1
    except httpx.ConnectError:
        tally.fail("connection refused (server restarting)")
        await asyncio.sleep(2.0)
    except httpx.HTTPError as exc:
        tally.fail(f"transport: {type(exc).__name__}")


def _message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"].split(":")[0]
    except (ValueError, KeyError, TypeError):
        return text[:60]


async def client_loop(
    server: Supervised, seed: int, tally: Tally, until: float, lost_after: float, cancels: list[asyncio.Event]
) -> None:
    rng, cancel = random.Random(seed), asyncio.Event()
    cancels.append(cancel)
    async with httpx.AsyncClient(timeout=httpx.Timeout(lost_after)) as client:
        while time.monotonic() < until:
            cancel.clear()
            await one_request(client, server.url, rng, tally, lost_after, cancel)


async def inject(fault: str, server: Supervised, cancels: list[asyncio.Event], tally: Tally) -> None:
    if fault == "engine-kill":
        pid = server.engine_pid()
        if pid:
            os.kill(pid, signal.SIGKILL)
    elif fault == "engine-freeze":
        pid = server.engine_pid()
        if pid:
            os.kill(pid, signal.SIGSTOP)
            await asyncio.sleep(5)
            os.kill(pid, signal.SIGCONT)
    elif fault == "disconnect-burst":
        for cancel in random.Random(len(tally.failed)).sample(cancels, max(1, len(cancels) // 5)):
            cancel.set()
    elif fault == "bad-input-burst":
        async with httpx.AsyncClient(timeout=60) as client:
            for field in ("top_k", "seed", "logit_bias", "stop_token_ids", "logprobs"):
                value = {"logit_bias": {str(HUGE): 1}, "stop_token_ids": [HUGE]}.get(field, HUGE)
                try:
                    r = await client.post(
                        f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 4, field: value}
                    )
                except httpx.HTTPError as exc:
                    tally.fail(f"bad input {field}: {type(exc).__name__}")
                    continue
                if r.status_code >= 500:  # a client mistake must never be a 5xx (200 or 400 are both fine)
                    tally.fail(f"bad input {field}: HTTP {r.status_code}")


async def soak(args) -> dict:
    server = Supervised(args.server_args)
    server.start()
    await server.wait_healthy()
    tally, cancels, rss, faults = Tally(), [], [], []
    start = time.monotonic()
    until = start + args.minutes * 60
    clients = [
        asyncio.create_task(client_loop(server, i, tally, until, args.lost_after, cancels)) for i in range(args.streams)
    ]

    async def sample_rss() -> None:
        while True:
            rss.append((time.monotonic() - start, server.rss_bytes()))
            await asyncio.sleep(1.0)

    async def supervise() -> None:  # the supervisor's part: start the server again when it exits
        while True:
            if server.proc.poll() is not None:
                faults.append((time.monotonic() - start, f"restart (exit {server.proc.returncode})"))
                server.restarts += 1
                await asyncio.to_thread(server.start)
                await server.wait_healthy()
                faults.append((time.monotonic() - start, "healthy again"))
            await asyncio.sleep(0.5)

    async def inject_faults() -> None:
        for k in range(10**6):
            await asyncio.sleep(max(0.0, start + (k + 1) * args.fault_every - time.monotonic()))
            fault = FAULTS[k % len(FAULTS)]
            faults.append((time.monotonic() - start, fault))
            print(f"{time.monotonic() - start:6.1f} s  fault: {fault}", flush=True)
            await inject(fault, server, cancels, tally)

    helpers = [asyncio.create_task(c()) for c in (sample_rss, supervise, inject_faults)]
    try:
        await asyncio.gather(*clients)
    finally:
        for task in clients + helpers:
            task.cancel()
        await asyncio.gather(*clients, *helpers, return_exceptions=True)
        server.stop()
    return {
        "streams": args.streams,
        "minutes": args.minutes,
        "served": tally.served,
        "failed": sum(tally.failed.values()),
        "failed_by_reason": dict(tally.failed.most_common()),
        "lost": tally.lost,
        "restarts": server.restarts,
        "faults": faults,
        "rss_mib": {"start": rss[0][1] / 2**20, "max": max(r for _, r in rss) / 2**20, "end": rss[-1][1] / 2**20},
        "rss": rss,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5), constrained_layout=True)
    ax.plot([t for t, _ in result["rss"]], [r / 2**20 for _, r in result["rss"]], lw=1)
    for t, fault in result["faults"]:
        ax.axvline(t, color="grey", ls=":", lw=0.8)
        ax.text(t, ax.get_ylim()[1], fault, rotation=90, va="top", ha="right", fontsize=7)
    ax.set_xlabel("seconds")
    ax.set_ylabel("RSS, server + engine (MiB)")
    ax.set_title(
        f"soak: {result['streams']} streams, served {result['served']}, failed {result['failed']}, "
        f"lost {result['lost']}"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--streams", type=int, default=256)
    p.add_argument("--fault-every", type=float, default=60, help="seconds between two faults")
    p.add_argument("--lost-after", type=float, default=300, help="a request with no answer after this is lost")
    p.add_argument("--out", default="runs/soak")
    p.add_argument("server_args", nargs="*", help="extra `rlserve serve` overrides (after --)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    result = asyncio.run(soak(args))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({k: v for k, v in result.items() if k != "rss"}, indent=1))
    plot(result, out / "rss.png")
    summary = {k: v for k, v in result.items() if k not in ("rss", "faults")}
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}/soak.json and {out}/rss.png")
    return 0 if result["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
