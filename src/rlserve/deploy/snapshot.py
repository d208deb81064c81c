"""A deployment's copy of weights a trainer pushed. A push (rlserve's broadcast, `/update_weights` without a
path; vLLM's weight transfer, `/update_weights {update_info}` and `/finish_weight_update`) leaves nothing on
disk, so once one has committed on every replica, one of them writes what it now serves into
deployment.snapshot_dir (server/fleet/save_weights.py) and the deployment's record names that directory as
its base weights: a restarted replica replays it like an update from disk, and the next push that fails on
one replica is undone on the others from it (deploy/transaction.py). The current and the previous copy are
kept; older ones are removed. Under Wide-EP no one server holds every expert: every server of one expert group
writes its engines' parts into the same directory, which must be on a filesystem all their nodes see."""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from pathlib import Path
from typing import Any

import httpx

from rlserve.deploy.replica import wide_ep
from rlserve.deploy.supervisor import Deployment, Slot
from rlserve.server.fleet.save_weights import SAVE_PATH, until_agreed

log = logging.getLogger("rlserve.deploy")
PREFIX = "push-"
# vLLM's weight-transfer routes that take part in a push; /update_weights {update_info} commits unless an
# update was opened by /start_weight_update, in which case /finish_weight_update does
TRANSFER_PATHS = ("/start_weight_update", "/finish_weight_update")


def is_broadcast_push(path: str, body: dict[str, Any]) -> bool:
    """rlserve's push: /update_weights naming no weights to read, received from the trainer's group."""
    return (
        path == "/update_weights"
        and "weight_path" not in body
        and "update_info" not in body
        and body.get("weight_dir") is None
    )


def is_push(path: str, body: dict[str, Any]) -> bool:
    """A call whose weights come from the trainer's group (only its members can take part)."""
    return (
        is_broadcast_push(path, body) or path in TRANSFER_PATHS or (path == "/update_weights" and "update_info" in body)
    )


def joins_group(path: str) -> bool:
    return path in ("/init_broadcaster", "/init_weight_transfer_engine")


async def set_aside(dep: Deployment, left_out: list[Slot]) -> None:
    """Serving replicas outside the trainer's group (restarted since it joined) did not get the push: out of the
    router's rotation until they replay the copy (the admin call rejoins every stale replica before it answers)."""
    for slot in left_out:
        slot.status, slot.detail = "stale", "not in the trainer's group: gets the pushed weights from their copy"
        if dep.router is not None and slot.url is not None:
            await dep.router.remove(dep.http, slot.url)
        log.warning("%s %s", slot.name, slot.detail)


async def keep_copy(dep: Deployment, applied: list[Slot]) -> None:
    """A push committed on every replica in `applied`: have one write it, and make that copy the record's base.
    Called under dep.lock. Without a copy (the replica cannot write one), restarted replicas sit out until
    the next update from disk, as the record's `replayable` says."""
    s = dep.state
    root = Path(str(dep.config.deployment.snapshot_dir))
    previous, written, why = (s.base or {}).get("weight_dir"), None, "no replica that applied it is serving"
    for group in _writers(dep, applied):  # the first that can: one killed while writing leaves the others
        names = ", ".join(slot.name for slot in group)
        try:
            target = root / f"{PREFIX}{s.policy_version}-{time.time_ns()}"
            written = await (_write_group(dep, group, target) if len(group) > 1 else _write(dep, group[0], target))
            break
        except (httpx.HTTPError, OSError, RuntimeError, ValueError, KeyError) as exc:
            why = f"{names}: {exc}"
            log.error("%s could not write a copy of the pushed weights: %s", names, exc)
    if written is None:
        s.base, s.replayable = None, f"the current weights came from a trainer broadcast and no copy was kept ({why})"
        return
    s.base, s.replayable = {"weight_dir": written["weight_dir"], "weight_version": s.weight_version}, None
    log.info("kept the pushed weights (policy_version %s) in %s", s.policy_version, written["weight_dir"])
    _prune(root, keep={Path(written["weight_dir"]).name, Path(str(previous)).name if previous else ""})


def _writers(dep: Deployment, applied: list[Slot]) -> list[list[Slot]]:
    """Who can write the copy, in the order to try: any one replica, or under Wide-EP the servers of an expert
    group (a copy of the deployment) that all applied the push."""
    if not wide_ep(dep.config):
        return [[slot] for slot in applied]
    groups = [[slot for slot in dep.slots if slot.copy == copy] for copy in range(dep.config.deployment.copies)]
    return [group for group in groups if all(slot in applied for slot in group)]


async def _write(dep: Deployment, slot: Slot, target: Path) -> dict[str, Any]:
    written = (await dep._post(slot, SAVE_PATH, {"weight_dir": str(target)})).json()
    _check_versions(dep, written)
    return written


async def _write_group(dep: Deployment, group: list[Slot], target: Path) -> dict[str, Any]:
    """Wide-EP: every server of the group writes its parts into the partial directory made here, then the first
    indexes them all and renames it into place."""
    partial = target.with_name(f".{target.name}.partial")
    partial.mkdir(mode=0o700, parents=True)

    async def write() -> list:
        replies = await asyncio.gather(
            *(dep._post(slot, SAVE_PATH, {"weight_dir": str(target), "parts_only": True}) for slot in group),
            return_exceptions=True,  # wait for every server: none may still write when a failure removes the directory
        )
        return [r if isinstance(r, BaseException) else r.json() for r in replies]

    def discard(parts: list) -> None:
        for name in (name for p in parts for name in p["files"]):
            (partial / name).unlink(missing_ok=True)

    try:
        parts = await until_agreed(
            write,
            lambda p: (p["policy_version"], p["weight_version"], p["placement_key"]),
            discard,
            "the servers' weights or expert placement",
        )
        _check_versions(dep, parts[0])
        files = [name for p in parts for name in p["files"]]
        await dep._post(group[0], SAVE_PATH, {"weight_dir": str(target), "index_parts": files})
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return parts[0] | {"weight_dir": str(target)}


def _check_versions(dep: Deployment, written: dict[str, Any]) -> None:
    s = dep.state
    if (written["policy_version"], written["weight_version"]) != (s.policy_version, s.weight_version):
        raise RuntimeError(f"the copy carries {written}, the deployment serves {s.policy_version}")


def _prune(root: Path, keep: set[str]) -> None:
    for path in root.iterdir() if root.is_dir() else ():
        if path.name.lstrip(".").startswith(PREFIX) and path.name not in keep:
            shutil.rmtree(path, ignore_errors=True)
