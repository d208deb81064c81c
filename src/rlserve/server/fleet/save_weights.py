"""A deployment's replica writes the weights it serves as a checkpoint directory, at the supervisor's request,
after a trainer's push (deploy/snapshot.py): the copy a restarted replica replays and a failed push is undone
from. The route exists only on a deployment's replicas (installed with server/fleet/deployment_guard.py,
which takes it only with the deployment's key), and writes only under the server's weight roots. Under expert
parallelism over data-parallel engines every engine writes its part (it alone holds its experts), and the
parts are indexed once all are written. Under Wide-EP (one expert group over several servers) no server holds
every expert, so the supervisor has each server of the group write its engines' parts into one directory
(`parts_only`), then one server index them and rename the directory into place (`index_parts`)."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from pathlib import Path

from fastapi import APIRouter, Request

from rlserve.model.loader import check_under_roots
from rlserve.runtime.weight_snapshot import checkpoint_tensors, write_checkpoint, write_index
from rlserve.server.errors import APIError, bad_request
from rlserve.server.state import ServerState, json_body

SAVE_PATH = "/deployment/save_weights"
PART_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
SHARED_DIR = "deployment.snapshot_dir must be on a filesystem that every node of the deployment mounts at the same path"

router = APIRouter()


@router.post(SAVE_PATH)
async def save_weights(request: Request) -> dict:
    """{"weight_dir": a directory that does not exist yet, under weight_roots}: written whole, then renamed
    into place, so a reader never finds part of it. Answers the versions the written weights carry.
    Wide-EP, in two steps over the group's servers: {"weight_dir", "parts_only": true} writes this server's
    parts (named by its engines' ranks in the whole group) into `.<name>.partial` beside it, which the
    supervisor made, and answers the files and the expert placement too; {"weight_dir", "index_parts": [every
    server's files]} then indexes them and renames the directory into place."""
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
    if body.get("parts_only", False) is not False:
        return await _group_parts(state, body, final, partial)
    if "index_parts" in body:
        return await _index_group(state, body, final, partial)
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


async def _group_parts(state: ServerState, body: dict, final: Path, partial: Path) -> dict:
    p = state.config.parallel
    if body["parts_only"] is not True:
        raise bad_request("parts_only must be true or left out", "parts_only")
    if not (p.enable_expert_parallel and p.dp_total != p.dp):
        raise bad_request(
            "parts_only is for a server whose expert group spans several servers (Wide-EP): leave it out, this "
            "server writes the whole checkpoint",
            "parts_only",
        )
    if not partial.is_dir():
        raise APIError(409, f"{partial} is not there on this server's node: {SHARED_DIR}", param="weight_dir")
    try:
        replies = await _parts(state.engine.engines, str(partial))
    except RuntimeError as exc:
        raise APIError(409, f"cannot write this server's parts of the served weights: {exc}") from None
    policy_version, weight_version, _, key = replies[0]
    return {
        "weight_dir": str(final),
        "policy_version": policy_version,
        "weight_version": weight_version,
        "placement_key": key,
        "files": [r[2] for r in replies],
    }


async def _index_group(state: ServerState, body: dict, final: Path, partial: Path) -> dict:
    files = body["index_parts"]
    if (
        not isinstance(files, list)
        or not files
        or not all(isinstance(f, str) and PART_NAME.fullmatch(f) for f in files)
    ):
        raise bad_request(
            "index_parts must list the parts' file names (model-0000r-of-0000N.safetensors)", "index_parts"
        )
    if not partial.is_dir():
        raise APIError(409, f"{partial} is not there on this server's node: {SHARED_DIR}", param="weight_dir")
    try:
        await asyncio.to_thread(write_index, str(partial), files, state.engine.shape)
        os.rename(partial, final)
    except (RuntimeError, OSError) as exc:  # a part missing here: written on another node's own disk
        raise APIError(409, f"cannot index the expert group's parts: {exc} ({SHARED_DIR})") from None
    return {"weight_dir": str(final)}


async def _write(state: ServerState, out_dir: str) -> list:
    engines, p = getattr(state.engine, "engines", None), state.config.parallel
    if p.enable_expert_parallel and p.dp_total != p.dp:
        raise RuntimeError(
            f"the expert group spans {p.dp_total} engines on several servers (Wide-EP), this server runs {p.dp} "
            "of them: no one server can write the whole checkpoint (each server writes its parts: parts_only)"
        )
    if engines and p.enable_expert_parallel:
        replies = await _parts(engines, out_dir)
        await asyncio.to_thread(write_index, out_dir, [r[2] for r in replies], state.engine.shape)
        return list(replies[0][:2])
    engine = engines[0] if engines else state.engine  # data parallel: every engine serves the same weights
    if hasattr(engine, "control"):  # the engine's own process
        return list(await engine.control("save_weights", out_dir))[:2]

    def copy(e) -> tuple:
        return checkpoint_tensors(e.model), [e.policy_version, e.weight_version]

    tensors, versions = await engine.call(copy)  # in this process's engine thread, between two steps
    await asyncio.to_thread(write_checkpoint, tensors, out_dir)
    return versions


async def _parts(engines: list, out_dir: str) -> list:
    """Each engine of the expert group writes its part; answers each engine's (policy_version, weight_version,
    file, placement key)."""

    def discard(replies: list) -> None:
        for r in replies:
            os.unlink(os.path.join(out_dir, r[2]))

    return await until_agreed(
        lambda: asyncio.gather(*(e.control("save_weights", out_dir) for e in engines), return_exceptions=True),
        lambda r: (r[0], r[1], r[3]),
        discard,
        "the engines' weights or expert placement",
    )


async def until_agreed(write, key, discard, what: str, tries: int = 3) -> list:
    """Await `write()`, every writer's reply (or exception) of one round, until the replies share one `key`;
    a round that does not agree is discarded first. Each writer copies between its own steps, so a rebalance
    or an update can land between two writers' copies: then their parts do not add up, and they write again."""
    for _ in range(tries):
        replies = await write()
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed
        if len({key(r) for r in replies}) == 1:
            return replies
        discard(replies)
    raise RuntimeError(f"{what} changed while they copied, {tries} times running")
