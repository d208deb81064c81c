"""All-or-none weight updates across a deployment: when an update of the base weights from disk, a trainer's
push, or a LoRA adapter load reaches some replicas and fails on others (a refusal, a replica killed mid-way),
the replicas that applied it are brought back to the previous weights (or adapter) and versions before the
admin call answers, so every replica serves what the deployment's record says and a retry starts from one
state. The previous base weights are a directory: the last update from disk, the copy kept of the last push
(deploy/snapshot.py), or the one the replicas started from.

A replica is restored while paused (mode keep): between the replayed commit and the version sync nothing is
generated, so no token ever carries a label of weights it was not computed with."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx

from rlserve.deploy.snapshot import is_push
from rlserve.deploy.supervisor import Deployment, Slot

log = logging.getLogger("rlserve.deploy")
SYNC_PATH = "/deployment/sync_version"
LORA_LOADS = ("/load_lora_adapter", "/v1/load_lora_adapter")

PutBack = Callable[[Deployment, Slot], Awaitable[None]]


def undo_for(path: str, body: dict[str, Any]) -> PutBack | None:
    """How to take back `path` on a replica that applied it, for the calls that are all-or-none; None for
    the others (a failure there takes the replica out of the rotation until it replays the record)."""
    if is_base_update_from_disk(path, body) or is_push(path, body):
        return _base_weights
    name = adapter_loaded_by(path, body)
    return None if name is None else _previous_adapter(name)


def adapter_loaded_by(path: str, body: dict[str, Any]) -> str | None:
    """The adapter name a LoRA load (vLLM's, SGLang's, or NeMo's `weight_path` form) writes."""
    if path in LORA_LOADS and body.get("lora_name"):
        return str(body["lora_name"])
    if path == "/update_weights" and "weight_path" in body:
        weight_path = Path(str(body["weight_path"]))
        if (weight_path / "adapter_config.json").exists():
            return str(body.get("model_name") or weight_path.name)
    return None


def is_base_update_from_disk(path: str, body: dict[str, Any]) -> bool:
    """The updates that can be undone by replaying the deployment's previous base weights."""
    if path == "/update_weights_from_disk":
        return True
    if path != "/update_weights" or "update_info" in body:
        return False
    if "weight_path" in body:
        return not (Path(str(body["weight_path"])) / "adapter_config.json").exists()
    return body.get("weight_dir") is not None


async def restore(dep: Deployment, applied: list[Slot], put_back: PutBack) -> list[Slot]:
    """Bring every replica in `applied` back to the recorded weights and versions (`put_back` undoes what
    the failed call changed); those that cannot be are returned (the caller evicts them: a restart replays
    the record before they rejoin). Called under dep.lock."""
    failed = []
    for slot in applied:
        try:
            await _restore_one(dep, slot, put_back)
        except (httpx.HTTPError, RuntimeError) as exc:
            slot.detail = f"could not be restored to the previous weights: {exc}"
            log.error("%s %s", slot.name, slot.detail)
            failed.append(slot)
    return failed


async def _restore_one(dep: Deployment, slot: Slot, put_back: PutBack) -> None:
    s = dep.state
    await dep._post(slot, "/pause", None, params={"mode": "keep"})
    await put_back(dep, slot)
    await dep._post(slot, SYNC_PATH, {"policy_version": s.policy_version, "weight_version": s.weight_version})
    if await dep._versions(slot) != (s.policy_version, s.weight_version):
        raise RuntimeError("versions differ after the restore")
    if s.paused is None:
        await dep._post(slot, "/resume", None)
    log.warning("%s restored to policy_version %s (%s)", slot.name, s.policy_version, s.weight_version)


async def _base_weights(dep: Deployment, slot: Slot) -> None:
    s = dep.state
    if s.replayable is not None:
        raise RuntimeError(s.replayable)
    base = s.base or {"weight_dir": await _startup_dir(dep, slot), "weight_version": s.weight_version}
    await dep._post(slot, "/update_weights", base)


def _previous_adapter(name: str) -> PutBack:
    async def put_back(dep: Deployment, slot: Slot) -> None:
        previous = dep.state.adapters.get(name)
        if previous is None:  # it was new: the replica serves without it again
            await dep._post(slot, "/v1/unload_lora_adapter", {"lora_name": name})
        else:  # reloaded in place from the path the record holds
            route, body = previous
            await dep._post(slot, route, body)

    return put_back


async def _startup_dir(dep: Deployment, slot: Slot) -> str:
    """No update from disk yet: the previous weights are the ones the replica started from."""
    r = await dep.http.get(f"{slot.url}/get_model_info", headers=dep.admin_auth())
    r.raise_for_status()
    return str(r.json()["model_path"])


def refused_unchanged(r: Any, before: tuple[int, str], now: tuple[int, str] | BaseException) -> bool:
    """A replica that answered a 4xx and still reports the previous versions kept the previous weights."""
    return isinstance(r, httpx.Response) and 400 <= r.status_code < 500 and now == before
