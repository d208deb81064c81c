"""All-or-none weight updates across a deployment: when an update of the base weights from disk reaches some
replicas and fails on others (a refusal, a replica killed mid-way), the replicas that applied it are brought
back to the previous weights and versions before the admin call answers, so every replica serves what the
deployment's record says and a retry starts from one state.

A replica is restored while paused (mode keep): between the replayed commit and the version sync nothing is
generated, so no token ever carries a label of weights it was not computed with."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx

from rlserve.deploy.supervisor import Deployment, Slot

log = logging.getLogger("rlserve.deploy")
SYNC_PATH = "/deployment/sync_version"


def is_base_update_from_disk(path: str, body: dict[str, Any]) -> bool:
    """The updates that can be undone by replaying the deployment's previous base weights."""
    if path == "/update_weights_from_disk":
        return True
    if path != "/update_weights" or "update_info" in body:
        return False
    if "weight_path" in body:
        return not (Path(str(body["weight_path"])) / "adapter_config.json").exists()
    return body.get("weight_dir") is not None


async def restore(dep: Deployment, applied: list[Slot]) -> list[Slot]:
    """Bring every replica in `applied` back to the recorded weights and versions; those that cannot be
    are returned (the caller evicts them: a restart replays the record before they rejoin). Called under
    dep.lock."""
    failed = []
    for slot in applied:
        try:
            await _restore_one(dep, slot)
        except (httpx.HTTPError, RuntimeError) as exc:
            slot.detail = f"could not be restored to the previous weights: {exc}"
            log.error("%s %s", slot.name, slot.detail)
            failed.append(slot)
    return failed


async def _restore_one(dep: Deployment, slot: Slot) -> None:
    s = dep.state
    if s.replayable is not None:
        raise RuntimeError(s.replayable)
    base = s.base or {"weight_dir": await _startup_dir(dep, slot), "weight_version": s.weight_version}
    await dep._post(slot, "/pause", None, params={"mode": "keep"})
    await dep._post(slot, "/update_weights", base)
    await dep._post(slot, SYNC_PATH, {"policy_version": s.policy_version, "weight_version": s.weight_version})
    if await dep._versions(slot) != (s.policy_version, s.weight_version):
        raise RuntimeError("versions differ after the restore")
    if s.paused is None:
        await dep._post(slot, "/resume", None)
    log.warning("%s restored to policy_version %s (%s)", slot.name, s.policy_version, s.weight_version)


async def _startup_dir(dep: Deployment, slot: Slot) -> str:
    """No update from disk yet: the previous weights are the ones the replica started from."""
    r = await dep.http.get(f"{slot.url}/get_model_info", headers=dep.admin_auth())
    r.raise_for_status()
    return str(r.json()["model_path"])


def refused_unchanged(r: Any, before: tuple[int, str], now: tuple[int, str] | BaseException) -> bool:
    """A replica that answered a 4xx and still reports the previous versions kept the previous weights."""
    return isinstance(r, httpx.Response) and 400 <= r.status_code < 500 and now == before
