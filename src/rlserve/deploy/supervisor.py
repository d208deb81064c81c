"""The deployment supervisor: starts the replicas and the router, restarts a replica that dies and lets
it rejoin only at the deployment's current weights, and keeps the record that makes that possible. Under
Wide-EP a copy's servers are one expert group and live and die together: one that dies or is evicted takes
the others out of the rotation, and all restart into a fresh rendezvous and rejoin at once."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from rlserve.config.schema import Config
from rlserve.deploy.liveness import watch_liveness
from rlserve.deploy.replica import wide_ep
from rlserve.deploy.router import Router

log = logging.getLogger("rlserve.deploy")
KEY_HEADER = "x-rlserve-deployment-key"
HEALTH_TIMEOUT_S = 600.0
RESTART_RETRY_S = 5.0  # between tries to restart a replica (or an expert group) that did not come up


class Replica(Protocol):
    index: int
    name: str

    def start(self) -> None: ...
    def wait_listening(self, timeout_s: float) -> str: ...
    def exited(self) -> int | None: ...
    def stop(self) -> None: ...


@dataclass
class WeightState:
    """What every serving replica has, so that a restarted one can be brought to it."""

    policy_version: int = 0
    weight_version: str = "default"
    base: dict[str, Any] | None = None  # /update_weights body of the last full update from disk
    adapters: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict)  # name -> (route, body)
    replayable: str | None = None  # None, or why a restarted replica cannot be brought to these weights
    paused: str | None = None  # pause mode while the deployment is paused


@dataclass(eq=False)
class Slot:
    replica: Replica
    copy: int = 0  # which copy of the deployment (deployment.copies): the router that sends it requests
    url: str | None = None
    status: str = "starting"  # starting | serving | stale | failed | restarting | unresponsive
    incarnation: int = 0
    detail: str = ""

    @property
    def name(self) -> str:
        return self.replica.name


class Deployment:
    def __init__(self, config: Config, replicas: list[Replica], key: str, host: str, port: int):
        self.config, self.key, self.host, self.port = config, key, host, port
        self.slots = [Slot(r, copy=config.deployment.copy_of(r.index)) for r in replicas]
        self.state = WeightState(weight_version=config.weight_version)
        self.routers: list[Router] = []  # one per copy, in copy order
        self.lock = asyncio.Lock()  # one admin mutation (or rejoin) at a time, so versions stay in step
        # no idle connections kept: a replica's server closes one it finds idle (after a pause or a freeze) just
        # as a call goes out on it, and an admin call cannot be resent blindly
        self.http = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_keepalive_connections=0)
        )
        self.group: set[tuple[int, int]] = set()  # (replica index, incarnation) in the trainer's broadcast group
        self._tasks: set[asyncio.Task] = set()
        self._routers_restarting: set[int] = set()

    @property
    def headers(self) -> dict[str, str]:
        return {KEY_HEADER: self.key}

    def serving(self) -> list[Slot]:
        return [s for s in self.slots if s.status == "serving"]

    @property
    def router(self) -> Router | None:
        """Copy 0's router: the deployment's public URL (server.port)."""
        return self.routers[0] if self.routers else None

    def router_of(self, slot: Slot) -> Router | None:
        return self.routers[slot.copy] if self.routers else None

    def members(self, slot: Slot) -> list[Slot]:
        """The slots that restart and rejoin with `slot`: under Wide-EP its copy's (one expert group, whose
        collectives every server must join), else itself."""
        return [s for s in self.slots if s.copy == slot.copy] if wide_ep(self.config) else [slot]

    # ---- start and stop ------------------------------------------------------------------------

    async def start(self) -> None:
        for slot in self.slots:
            slot.replica.start()
        urls = await asyncio.gather(*(self._wait_ready(s) for s in self.slots))
        for slot, url in zip(self.slots, urls):
            slot.url, slot.status = url, "serving"
        info = await self._versions(self.slots[0])
        self.state.policy_version, self.state.weight_version = info
        d = self.config.deployment
        for copy in range(d.copies):
            router = Router(self.config, self.host, d.router_port(copy, self.port))
            self.routers.append(router)
            slots = [s for s in self.slots if s.copy == copy]
            await router.start([s.url for s in slots], roles=[getattr(s.replica, "role", None) for s in slots])

    async def _wait_ready(self, slot: Slot) -> str:
        url = await asyncio.to_thread(slot.replica.wait_listening, HEALTH_TIMEOUT_S)
        deadline = asyncio.get_running_loop().time() + HEALTH_TIMEOUT_S
        while True:
            try:
                if (await self.http.get(f"{url}/health", timeout=5)).status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if slot.replica.exited() is not None or asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"{slot.name} did not become healthy at {url}")
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await asyncio.gather(*(asyncio.to_thread(r.stop) for r in self.routers))
        await asyncio.gather(*(asyncio.to_thread(s.replica.stop) for s in self.slots))
        await self.http.aclose()

    # ---- supervision ---------------------------------------------------------------------------

    async def watch(self, interval_s: float = 0.2) -> None:
        """Restart every replica whose process ended; it rejoins once it serves the current weights. One that
        stops answering without exiting leaves the rotation until it answers again (deploy/liveness.py)."""
        self._spawn(watch_liveness(self))
        while True:
            for copy, router in enumerate(self.routers):
                if router.exited() is not None and copy not in self._routers_restarting:
                    log.warning("vllm-router of copy %d exited with code %s; restarting it", copy, router.exited())
                    self._routers_restarting.add(copy)
                    self._spawn(self._restart_router(copy))
            for slot in self.slots:
                if slot.status != "restarting" and slot.replica.exited() is not None:
                    code = slot.replica.exited()
                    log.warning("%s (%s) exited with code %s; restarting it", slot.name, slot.url, code)
                    self._spawn(self._restart(self._take_down(slot, f"exited with code {code}")))
            await asyncio.sleep(interval_s)

    def _take_down(self, slot: Slot, why: str) -> list[Slot]:
        """Mark `slot` and the members of its group restarting (before any await, so the watch loop seeing a
        member exit meanwhile does not restart it a second time); the slots to restart."""
        slots = [s for s in self.members(slot) if s is slot or s.status != "restarting"]
        for member in slots:
            member.status = "restarting"
            member.detail = why if member is slot else f"its expert group is restarting: {slot.name} {why}"
        if len(slots) > 1:
            log.warning("restarting %s with %s: one expert group", ", ".join(s.name for s in slots), slot.name)
        return slots

    async def _restart_router(self, copy: int) -> None:
        router = self.routers[copy]
        try:
            await asyncio.to_thread(router.stop)
            await router.start([s.url for s in self.serving() if s.url and s.copy == copy])  # same port as before
        finally:
            self._routers_restarting.discard(copy)

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _restart(self, slots: list[Slot]) -> None:
        """Stop the slots' processes and start new ones (an expert group's all together: a survivor's engines
        would only wait in collectives with the dead one until they time out), then rejoin them."""
        router = self.router_of(slots[0])
        for slot in slots:
            if slot.url is not None and router is not None:
                await router.remove(self.http, slot.url)
        while True:
            await asyncio.gather(*(asyncio.to_thread(s.replica.stop) for s in slots))
            if len(slots) > 1 and self.config.deployment.on_ray:
                from rlserve.deploy.ray_nodes import new_rendezvous

                new_rendezvous(self.config, [s.replica for s in slots])
            for slot in slots:
                slot.replica.start()  # on the event loop's thread: children die with the thread that forked them
                slot.incarnation += 1
            waits = [asyncio.ensure_future(self._wait_ready(s)) for s in slots]
            # the first failure settles it: a group's other members would wait at its rendezvous for the failed one
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_EXCEPTION)
            finally:  # also when the deployment stops meanwhile
                for w in waits:
                    if not w.done():
                        w.cancel()
            # a wait just cancelled is not done yet: only the finished ones say how they ended
            failed = [
                (s, w.exception()) for s, w in zip(slots, waits) if w.done() and not w.cancelled() and w.exception()
            ]
            if not failed:
                urls = [w.result() for w in waits]
                break
            why = "; ".join(f"{s.name} did not start: {e}" for s, e in failed)
            log.error("%s; starting %s again in %.0f s", why, ", ".join(s.name for s in slots), RESTART_RETRY_S)
            for slot in slots:
                slot.detail = why
            await asyncio.sleep(RESTART_RETRY_S)
        for slot, url in zip(slots, urls):
            slot.url = url
        async with self.lock:
            await self.rejoin(slots[0])

    async def rejoin(self, slot: Slot) -> None:
        """Replay the current weights into a replica that is out of the rotation, then add it back; under
        Wide-EP every member of its group out of the rotation, all replayed before any serves (a member still
        at other weights would compute the others' experts). Called under self.lock."""
        s = self.state
        slots = [m for m in self.members(slot) if m is slot or m.status != "serving"]
        if s.replayable is not None:
            for member in slots:
                member.status, member.detail = "stale", f"sits out until the next weight update: {s.replayable}"
                log.warning("%s %s", member.name, member.detail)
            return
        try:
            for member in slots:
                await self._replay(member)
        except (httpx.HTTPError, RuntimeError) as exc:
            for member in slots:
                member.status, member.detail = "failed", f"could not be brought to the current weights: {exc}"
                log.error("%s %s", member.name, member.detail)
            return
        for member in slots:
            router = self.router_of(member)
            assert router is not None and member.url is not None
            await router.add(self.http, member.url, getattr(member.replica, "role", None))
            member.status, member.detail = "serving", ""
            log.info("%s rejoined at policy_version %s (%s)", member.name, s.policy_version, s.weight_version)

    async def _replay(self, slot: Slot) -> None:
        s = self.state
        if s.base is not None:
            await self._post(slot, "/update_weights", s.base)
        for route, body in s.adapters.values():
            await self._post(slot, route, body)
        await self._post(
            slot,
            "/deployment/sync_version",
            {"policy_version": s.policy_version, "weight_version": s.weight_version},
        )
        if await self._versions(slot) != (s.policy_version, s.weight_version):
            raise RuntimeError(f"{slot.name}: versions differ after the replay")
        if s.paused is not None:
            await self._post(slot, "/pause", None, params={"mode": s.paused})

    async def evict(self, slot: Slot, why: str) -> None:
        """Out of the rotation now; its process (under Wide-EP, its whole group) is restarted and rejoins at the
        current weights."""
        if slot.status == "restarting":  # the watch loop saw it die first
            return
        # marked before the first await, or the watch loop seeing it die meanwhile restarts it a second time
        slots = self._take_down(slot, why)
        router = self.router_of(slot)
        if router is not None and slot.url is not None:
            await router.remove(self.http, slot.url)
        log.error("%s left the router's rotation: %s", slot.name, why)
        self._spawn(self._restart(slots))

    # ---- talking to replicas ---------------------------------------------------------------------

    async def _post(
        self, slot: Slot, path: str, body: dict[str, Any] | None, params: dict[str, str] | None = None
    ) -> Any:
        r = await self.http.post(
            f"{slot.url}{path}", json=body, params=params, headers=self.headers | self.admin_auth()
        )
        if r.status_code >= 400:
            raise RuntimeError(f"{path} answered {r.status_code}: {r.text[:300]}")
        return r

    def admin_auth(self) -> dict[str, str]:
        key = self.config.server.admin_api_key or self.config.server.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def _versions(self, slot: Slot) -> tuple[int, str]:
        r = await self.http.get(f"{slot.url}/get_weight_version", headers=self.admin_auth())
        r.raise_for_status()
        data = r.json()
        return int(data["policy_version"]), str(data["weight_version"])

    async def describe(self) -> dict[str, Any]:
        """GET /deployment: every replica with its URL, health, versions and load."""

        async def one(slot: Slot) -> dict[str, Any]:
            row = {
                "index": slot.replica.index,
                "copy": slot.copy,
                "role": getattr(slot.replica, "role", None),
                "url": slot.url,
                "status": slot.status,
                "detail": slot.detail,
                "restarts": slot.incarnation,
                "pid": getattr(slot.replica, "pid", None),
                "healthy": False,
            }
            try:
                r = await self.http.get(
                    f"{slot.url}/metrics", params={"format": "json"}, headers=self.admin_auth(), timeout=5
                )
                m = r.json()
                row |= {
                    "healthy": r.status_code == 200,
                    "policy_version": m.get("current_policy_version"),
                    "weight_version": m.get("weight_version"),
                    "running": m.get("num_running"),
                    "waiting": m.get("queue_depth"),
                    "is_paused": m.get("is_paused"),
                }
            except (httpx.HTTPError, ValueError, AttributeError):
                pass
            return row

        rows = await asyncio.gather(*(one(s) for s in self.slots))
        s = self.state
        routers = [
            {"copy": c, "url": r.url, "pid": r.child.pid if r.child else None} for c, r in enumerate(self.routers)
        ]
        return {
            "router": routers[0]["url"] if routers else None,  # copy 0's: the deployment's public URL
            "router_pid": routers[0]["pid"] if routers else None,
            "routers": routers,
            "policy_version": s.policy_version,
            "weight_version": s.weight_version,
            "paused": s.paused,
            "replicas": rows,
        }


def new_key() -> str:
    return secrets.token_urlsafe(32)


def private_dir(prefix: str) -> Path:
    import tempfile

    path = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(path, 0o700)
    return path
