"""Replicas that stop answering without exiting (frozen by SIGSTOP, swapped out, stuck): the supervisor probes
every replica's /health and takes one out of the router's rotation after deployment.health_check's
failure_threshold probes in a row get no healthy answer; it comes back once it answers again. Requests already on
it are not moved (a router retry would run them twice): they finish, or fail clearly, when it resumes.

Under Wide-EP a member that does not answer stalls its whole expert group (every engine steps with it), and the
others' collectives would fail once parallel.expert_group_timeout_s passed, leaving it unable to rejoin them: the
group is restarted at once instead (Deployment.evict), so the stall lasts those probes, not that timeout.

vllm-router's own health checks would take minutes (60 s apart by default) and would not reconcile what the
replica missed while out: here a replica that comes back is brought to the deployment's pause state, and one
that missed an update is restarted, so it rejoins at the current weights. Bringing one back runs beside the
probes and is bounded (health_check.readmit_timeout_s): a replica whose server answers again while its engine
does not (the engine process still frozen) is restarted, rather than holding the deployment's lock and every
later probe."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

log = logging.getLogger("rlserve.deploy")
UNRESPONSIVE = "unresponsive"


async def watch_liveness(dep: Any) -> None:
    """Runs for the deployment's lifetime beside its exit watch (Deployment.watch)."""
    probes = dep.config.deployment.health_check
    misses: dict[int, int] = {}
    readmitting: set[int] = set()
    while True:
        slots = [s for s in dep.slots if s.status in ("serving", UNRESPONSIVE) and s.url]
        answers = await asyncio.gather(*(_healthy(dep, s) for s in slots))
        misses = {id(s): misses.get(id(s), 0) for s in slots}  # a restarted replica starts from no misses
        for slot, healthy in zip(slots, answers):
            key = id(slot)
            misses[key] = 0 if healthy else misses.get(key, 0) + 1
            if healthy and slot.status == UNRESPONSIVE:
                if key not in readmitting:
                    readmitting.add(key)
                    dep._spawn(_readmit(dep, slot, readmitting))
            elif misses[key] >= probes.failure_threshold and slot.status == "serving":
                await _take_out(dep, slot, misses[key])
        await asyncio.sleep(probes.interval_s)


async def _healthy(dep: Any, slot: Any) -> bool:
    try:
        r = await dep.http.get(f"{slot.url}/health", timeout=dep.config.deployment.health_check.timeout_s)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


async def _take_out(dep: Any, slot: Any, misses: int) -> None:
    # not under dep.lock: an admin fan-out may hold it while it waits on this very replica
    why = f"no healthy answer to {misses} /health probes in a row ({dep.config.deployment.health_check.timeout_s:g} s each)"
    if len(dep.members(slot)) > 1:
        await dep.evict(slot, f"{why}, which stalls its expert group")
        return
    slot.status, slot.detail = UNRESPONSIVE, why
    log.error("%s (%s) left the router's rotation: %s", slot.name, slot.url, slot.detail)
    if (router := dep.router_of(slot)) is not None:
        await router.remove(dep.http, slot.url)


async def _readmit(dep: Any, slot: Any, readmitting: set[int]) -> None:
    try:
        async with dep.lock:
            if slot.status != UNRESPONSIVE:
                return
            limit = dep.config.deployment.health_check.readmit_timeout_s
            try:
                why = await asyncio.wait_for(_to_deployment_state(dep, slot), limit)
            except asyncio.TimeoutError:
                why = f"answered /health again, but its engine not within {limit:g} s"
            except (httpx.HTTPError, RuntimeError) as exc:
                why = f"could not be brought back after it answered again: {exc}"
            if why is not None:
                await dep.evict(slot, why)
                return
            slot.status, slot.detail = "serving", ""
            log.warning("%s (%s) answers again and is back in the router's rotation", slot.name, slot.url)
    finally:
        readmitting.discard(id(slot))


async def _to_deployment_state(dep: Any, slot: Any) -> str | None:
    """Brings a replica that answers again to the deployment's pause state and back into its router's rotation;
    or says why it must be restarted instead."""
    s = dep.state
    if await dep._versions(slot) != (s.policy_version, s.weight_version):
        return "it missed a weight update while it did not answer"
    # it may have missed a /pause or /resume: take the deployment's state
    if s.paused is None:
        await dep._post(slot, "/resume", None)
    else:
        await dep._post(slot, "/pause", None, params={"mode": s.paused})
    await dep.router_of(slot).add(dep.http, slot.url, getattr(slot.replica, "role", None))
    return None
