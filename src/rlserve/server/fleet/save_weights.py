"""A deployment's replica writes the weights it serves as a checkpoint directory, at the supervisor's request,
after a trainer's push (deploy/snapshot.py): the copy a restarted replica replays and a failed push is undone
from. The route exists only on a deployment's replicas (installed with server/fleet/deployment_guard.py,
which takes it only with the deployment's key), and writes only under the server's weight roots. Under expert
parallelism over data-parallel engines every engine writes its part (it alone holds its experts), and the
parts are indexed once all are written."""

from __future__ import annotations

import asyncio
import os
import shutil

from fastapi import APIRouter, Request

from rlserve.model.loader import check_under_roots
from rlserve.runtime.weight_snapshot import checkpoint_tensors, write_checkpoint, write_index
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
        partial.mkdir(mode=0o700)
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
    engines, p = getattr(state.engine, "engines", None), state.config.parallel
    if p.enable_expert_parallel and p.dp_total != p.dp:
        raise RuntimeError(
            f"the expert group spans {p.dp_total} engines on several servers (Wide-EP), this server runs {p.dp} "
            "of them: no one server can write the whole checkpoint"
        )
    if engines and p.enable_expert_parallel:
        return await _write_parts(state, engines, out_dir)
    engine = engines[0] if engines else state.engine  # data parallel: every engine serves the same weights
    if hasattr(engine, "control"):  # the engine's own process
        return list(await engine.control("save_weights", out_dir))[:2]

    def copy(e) -> tuple:
        return checkpoint_tensors(e.model), [e.policy_version, e.weight_version]

    tensors, versions = await engine.call(copy)  # in this process's engine thread, between two steps
    await asyncio.to_thread(write_checkpoint, tensors, out_dir)
    return versions


async def _write_parts(state: ServerState, engines: list, out_dir: str, tries: int = 3) -> list:
    """Each engine of the expert group writes its part. An engine copies between its own steps, so a rebalance
    or an update can land between two engines' copies: then their parts may not add up, and they write again."""
    for _ in range(tries):
        replies = await asyncio.gather(*(e.control("save_weights", out_dir) for e in engines), return_exceptions=True)
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        if len({(r[0], r[1], r[3]) for r in replies}) == 1:
            await asyncio.to_thread(write_index, out_dir, [r[2] for r in replies], state.engine.shape)
            return list(replies[0][:2])
        for r in replies:
            os.unlink(os.path.join(out_dir, r[2]))
    raise RuntimeError(f"the engines' weights or expert placement changed while they copied, {tries} times running")
