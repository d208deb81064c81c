"""The `vllm-router` binary in front of the replicas, launched with the contract of wire-protocols §1.1."""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
from pathlib import Path

import httpx

from rlserve.config import Config
from rlserve.deploy.process import Child, free_port


def router_argv(config: Config, host: str, port: int, worker_urls: list[str], prometheus_port: int) -> list[str]:
    r = config.deployment.router
    argv = [_binary(), "--host", host, "--port", str(port), "--policy", r.policy,
            "--worker-urls", *worker_urls,
            "--request-id-headers", "x-session-id",
            "--worker-startup-timeout-secs", "4200",
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
            # its INFO level logs every routing decision: too much to pass through the supervisor
            "--log-level", "debug" if config.server.log_level.lower() == "debug" else "warning"]
    dp = getattr(getattr(config, "parallel", None), "dp", None)  # engines behind one port, when configured
    if isinstance(dp, int) and dp > 1:
        argv += ["--intra-node-data-parallel-size", str(dp)]
    return argv + list(r.extra_args)


def _binary() -> str:
    found = shutil.which("vllm-router") or str(Path(sys.executable).with_name("vllm-router"))
    if not Path(found).exists():
        raise RuntimeError("the vllm-router binary is missing: pip install vllm-router (an rlserve dependency)")
    return found


class Router:
    """The router process and its worker list (/add_worker, /remove_worker on its own port)."""

    def __init__(self, config: Config, host: str, port: int):
        self.config, self.host, self.port = config, host, port
        self.child: Child | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, worker_urls: list[str], attempts: int = 3) -> None:
        fixed = self.port
        async with httpx.AsyncClient(timeout=2) as http:
            for _ in range(attempts):  # a port picked here may be taken by the time the router binds it
                self.port = fixed or free_port(self.host)
                argv = router_argv(self.config, self.host, self.port, worker_urls, free_port("127.0.0.1"))
                self.child = Child("router", argv)
                if await self._wait_up(http, 60.0):
                    return
                await asyncio.to_thread(self.child.stop)
                if fixed:
                    break
        raise RuntimeError(f"vllm-router did not start on {self.host}:{self.port} (see its [router] log lines)")

    async def _wait_up(self, http: httpx.AsyncClient, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.child is not None and self.child.exited() is None:
            try:
                if (await http.get(f"{self.url}/list_workers")).status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
        return False

    async def workers(self, http: httpx.AsyncClient) -> list[str]:
        r = await http.get(f"{self.url}/list_workers", timeout=10)
        return list(r.json().get("urls", []))

    async def add(self, http: httpx.AsyncClient, url: str) -> None:
        if url not in await self.workers(http):
            (await http.post(f"{self.url}/add_worker", params={"url": url}, timeout=600)).raise_for_status()

    async def remove(self, http: httpx.AsyncClient, url: str) -> None:
        if url in await self.workers(http):
            await http.post(f"{self.url}/remove_worker", params={"url": url}, timeout=10)

    def exited(self) -> int | None:
        return None if self.child is None else self.child.exited()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
