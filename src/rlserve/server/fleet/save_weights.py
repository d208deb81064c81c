"""A deployment's replica writes the weights it serves as a checkpoint directory, at the supervisor's request,
after a trainer's push (deploy/snapshot.py): the copy a restarted replica replays and a failed push is undone
from. The route exists only on a deployment's replicas (installed with server/fleet/deployment_guard.py,
which takes it only with the deployment's key), and writes only under the server's weight roots."""

from __future__ import annotations

import asyncio
import os
import shutil

from fastapi import APIRouter, Request

from rlserve.model.loader import check_under_roots
from rlserve.runtime.weight_snapshot import checkpoint_tensors, write_checkpoint
from rlserve.server.errors import APIError, bad_request
from rlserve.server.state import ServerState, json_body

SAVE_PATH = "/deployment/save_weights"

router = APIRouter()


@router.post(SAVE_PATH)
async def save_weights(request: Request) -> dict:
    """{"weight_dir": a directory that does not exist yet, under weight_roots}: written whole, then renamed
    into place, so a reader never finds part of it. Answers the versions the written weights carry."""
    body = await json_body(request)
    state: ServerState = request.app.state.rlserve
    target = body.get("weight_dir")
    if not isinstance(target, str) or not target:
        raise bad_request("weight_dir (a directory path to create) is required", "weight_dir")
    try:
        final = check_under_roots(target, state.config.weight_roots)
    except PermissionError as exc:
        raise APIError(403, str(exc), param="weight_dir") from None
    if final.exists():
        raise APIError(409, f"{target} exists already: name a new directory", param="weight_dir")
    partial = final.with_name(f".{final.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a replica killed while writing
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        versions = await _write(state, str(partial))
        os.rename(partial, final)
    except RuntimeError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise APIError(409, f"cannot write the served weights: {exc}") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return {"weight_dir": str(final), "policy_version": versions[0], "weight_version": versions[1]}


async def _write(state: ServerState, out_dir: str) -> list:
    engines = getattr(state.engine, "engines", None)
    engine = engines[0] if engines else state.engine  # data parallel: every engine serves the same weights
    if hasattr(engine, "control"):  # the engine's own process
        return list(await engine.control("save_weights", out_dir))

    def copy(e) -> tuple:
        return checkpoint_tensors(e.model), [e.policy_version, e.weight_version]

    tensors, versions = await engine.call(copy)  # in this process's engine thread, between two steps
    await asyncio.to_thread(write_checkpoint, tensors, out_dir)
    return versions
