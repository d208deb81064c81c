"""The `vllm-router` binary in front of the replicas, launched with the contract of docs/protocols.md §1.1."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sys
import time
from pathlib import Path

import httpx

from rlserve.config.schema import Config
from rlserve.deploy.process import Child
from rlserve.deploy.replica import engines_per_replica
from rlserve.runtime.ports import free_port

log = logging.getLogger("rlserve.deploy")


def router_argv(
    config: Config,
    host: str,
    port: int,
    worker_urls: list[str],
    prometheus_port: int,
    roles: list[str | None] | None = None,
) -> list[str]:
    """`roles` (disaggregated): "prefill" or "decode" per worker URL, for the router's P/D mode (§1.2)."""
    r = config.deployment.router
    argv = [_binary(), "--host", host, "--port", str(port), "--policy", r.policy]
    if roles is not None and any(roles):
        argv.append("--vllm-pd-disaggregation")
        for url, role in zip(worker_urls, roles):
            argv += ["--prefill", url] if role == "prefill" else ["--decode", url]
    else:
        argv += ["--worker-urls", *worker_urls]
    argv += [
        "--request-id-headers",
        "x-session-id",
        "--worker-startup-timeout-secs",
        "4200",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prometheus_port),
        # its INFO level logs every routing decision: too much to pass through the supervisor
        "--log-level",
        "debug" if config.server.log_level.lower() == "debug" else "warning",
    ]
    dp = engines_per_replica(config)  # engines behind one port
    if dp > 1:
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
        self.pd = config.deployment.type == "disaggregated"
        self.roles: dict[str, str | None] = {}  # P/D mode: worker URL -> role, for restarts with a new list
        self._live: list[str] = []  # P/D mode: the worker URLs the running router was started with

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self, worker_urls: list[str], attempts: int = 3, roles: list[str | None] | None = None) -> None:
        if roles is not None:
            self.roles = dict(zip(worker_urls, roles))
        roles = [self.roles.get(u) for u in worker_urls] if self.pd else None
        if roles is not None and not {"prefill", "decode"} <= set(roles):
            # P/D mode needs both kinds: nothing is served until the missing one rejoins (add)
            log.warning("vllm-router waits for a prefill and a decode replica to serve (has %s)", worker_urls)
            self.child, self._live = None, list(worker_urls)
            return
        fixed = self.port
        async with httpx.AsyncClient(timeout=2) as http:
            for _ in range(attempts):  # a port picked here may be taken by the time the router binds it
                self.port = fixed or free_port(self.host)
                argv = router_argv(self.config, self.host, self.port, worker_urls, free_port("127.0.0.1"), roles)
                self.child = Child("router", argv)
                if await self._wait_up(http, 60.0):
                    self._live = list(worker_urls)
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
        if self.pd:
            return list(self.live)
        r = await http.get(f"{self.url}/list_workers", timeout=10)
        return list(r.json().get("urls", []))

    async def add(self, http: httpx.AsyncClient, url: str, role: str | None = None) -> None:
        if self.pd:  # P/D mode has no worker list to edit: the router restarts with the new list
            self.roles[url] = role  # a restarted replica may listen on a new port
            if url not in self.live:
                await self._restart_with([*self.live, url])
            return
        if url not in await self.workers(http):
            (await http.post(f"{self.url}/add_worker", params={"url": url}, timeout=600)).raise_for_status()

    async def remove(self, http: httpx.AsyncClient, url: str) -> None:
        if self.pd:
            if url in self.live:
                await self._restart_with([u for u in self.live if u != url])
            return
        if url in await self.workers(http):
            await http.post(f"{self.url}/remove_worker", params={"url": url}, timeout=10)

    @property
    def live(self) -> list[str]:
        """P/D mode: the worker URLs the running router was started with."""
        return list(self._live)

    async def _restart_with(self, urls: list[str]) -> None:
        await asyncio.to_thread(self.stop)
        await self.start(urls)

    def exited(self) -> int | None:
        return None if self.child is None else self.child.exited()

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
