"""vLLM 0.32's RL routes on a server whose engine runs in its own process (the default), and under
data parallelism: the weight-transfer calls (vllm_weights.py's routes) go to each engine process,
which joins the trainer's group, receives, proves and commits there (engine/vllm_receiver.py).
Also /shutdown_weight_transfer_engine, /weight_info and /weight_checker as vLLM answers them.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import torch
from fastapi import APIRouter, Request

from rlserve.engine.weights import WeightUpdateError
from rlserve.runtime.face import EngineDeadError
from rlserve.server.errors import APIError, bad_request
from rlserve.server.state import ServerState, json_body

router = APIRouter()


def in_process(state: ServerState) -> bool:
    """True unless the engine runs in the server's own thread (engine.core_process false)."""
    return getattr(state.engine, "engine", None) is None


def _engines(state: ServerState) -> list[Any]:
    return list(getattr(state.engine, "engines", None) or [state.engine])


async def on_engines(state: ServerState, op: str, *args: Any) -> list[Any]:
    return await _answer(state, asyncio.gather(*(e.control(op, *args) for e in _engines(state))))


async def _unless_draining(state: ServerState, calls: Any) -> list[Any]:
    """Wait for the engines, but not past a SIGTERM: a rendezvous or broadcast may wait on a trainer for
    minutes, and the server's shutdown waits for open requests (the engine process is stopped after)."""
    task = asyncio.ensure_future(calls)
    while not task.done():
        await asyncio.wait({task}, timeout=0.1)
        if state.draining and not task.done():
            task.cancel()
            raise APIError(503, "the server is shutting down; the weight transfer was abandoned")
    return list(task.result())


async def _answer(state: ServerState, calls: Any) -> list[Any]:
    """The engine's refusals as HTTP: a push that does not prove out 400, a state that forbids it 409."""
    try:
        return await _unless_draining(state, calls)
    except (WeightUpdateError, ValueError) as exc:
        raise APIError(400, str(exc), param="update_info") from None
    except TimeoutError as exc:
        raise APIError(504, str(exc)) from None
    except EngineDeadError:
        raise
    except RuntimeError as exc:
        raise APIError(409, str(exc)) from None


def packed_fields(info: dict, field: str) -> tuple[bool | None, int | None]:
    """`packed` and `packed_buffer_size_bytes` as sent in init_info or update_info; None where absent."""
    packed, size = info.get("packed"), info.get("packed_buffer_size_bytes")
    if packed is not None and not isinstance(packed, bool):
        raise bad_request(f"{field}.packed must be true or false, got {packed!r}", field)
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size <= 0):
        raise bad_request(f"{field}.packed_buffer_size_bytes must be a positive integer, got {size!r}", field)
    return packed, size


async def init(
    state: ServerState,
    host: str,
    port: int,
    rank: int,
    world: int,
    timeout: float,
    packed: tuple[bool | None, int | None],
) -> None:
    engines = _engines(state)
    if rank + len(engines) > world:
        raise bad_request(
            f"world_size {world} leaves no rank for {len(engines)} engine(s) from rank_offset {rank}: "
            f"this server has {len(engines)} receiving engine(s) (GET /get_world_size)",
            "init_info",
        )
    try:
        # each data-parallel engine is its own member of the trainer's group, at consecutive ranks
        await _answer(
            state,
            asyncio.gather(
                *(e.control("vllm_init", host, port, rank + i, world, timeout, *packed) for i, e in enumerate(engines))
            ),
        )
    except APIError as exc:
        if exc.status == 504:  # the members that did join leave again
            await asyncio.gather(*(e.control("vllm_shutdown") for e in engines), return_exceptions=True)
        raise


def _update_info(info: dict) -> tuple[list[str], list[str], list[list[int]], dict[str, str] | None]:
    names, dtype_names, shapes = info.get("names"), info.get("dtype_names"), info.get("shapes")
    if not (
        isinstance(names, list)
        and isinstance(dtype_names, list)
        and isinstance(shapes, list)
        and len(names) == len(dtype_names) == len(shapes)
        and names
    ):
        raise bad_request(
            "update_info needs names, dtype_names and shapes: lists of one equal, non-zero length", "update_info"
        )
    for name, d, shape in zip(names, dtype_names, shapes):
        dtype = getattr(torch, str(d).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise bad_request(
                f"{name}: dtype {d!r} cannot carry weights; use float32, bfloat16 or float16", "update_info"
            )
        if not (
            isinstance(shape, list) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape)
        ):
            raise bad_request(f"{name}: shape must be a list of non-negative integers, got {shape!r}", "update_info")
    checksums = info.get("checksums")
    if checksums is not None and not (
        isinstance(checksums, dict) and all(isinstance(v, str) for v in checksums.values())
    ):
        raise bad_request("update_info.checksums must map tensor names to sha256 hex digests", "update_info")
    return [str(n) for n in names], [str(d) for d in dtype_names], shapes, checksums


async def receive(state: ServerState, info: dict, label: str | None, inflight: str | None) -> dict:
    names, dtype_names, shapes, checksums = _update_info(info)
    packed, size = packed_fields(info, "update_info")
    versions = await on_engines(
        state, "vllm_receive", names, dtype_names, shapes, packed, size, checksums, label, inflight
    )
    await state.engine.refresh()
    return {"message": "Weights updated", "policy_version": versions[0]}


async def finish(state: ServerState, label: str | None, inflight: str | None) -> int:
    versions = await on_engines(state, "vllm_finish", label, inflight)
    await state.engine.refresh()
    return versions[0]


@router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    """vLLM's {"weight_version"}, with policy_version beside it; ?checksums=true adds /weight_checker's digests
    of the weights now serving."""
    state = request.app.state.rlserve
    out = {"weight_version": state.engine.weight_version, "policy_version": state.engine.policy_version}
    if request.query_params.get("checksums", "false").lower() == "true":
        if not in_process(state):
            raise APIError(
                400, "checksums need the engine in its own process (the default engine.core_process)", param="checksums"
            )
        out["checksums"] = await _checksums(state)
    return out


async def _checksums(state: ServerState) -> dict[str, str]:
    checksums: dict[str, str] = {}
    for i, engine in enumerate(_engines(state)):
        checksums.update(await engine.control("vllm_checksums", f"dp{i}:pp0:pcp0:tp0:"))
    return checksums


@router.post("/weight_checker")
async def weight_checker(request: Request) -> dict:
    """vLLM's actions: checksum (sha256 of each parameter's bytes, keyed dp<i>:pp0:pcp0:tp0:<name>),
    reset (zero the weights, for testing a push) and compare against a baseline of the same form."""
    state, body = request.app.state.rlserve, await json_body(request)
    action, baseline = body.get("action"), body.get("baseline")
    if action not in ("checksum", "reset", "compare"):
        raise bad_request(f"action must be checksum, reset or compare, got {action!r}", "action")
    if not in_process(state):
        raise APIError(
            400, "weight_checker needs the engine in its own process (the default engine.core_process)", param="action"
        )
    if action == "reset":
        await on_engines(state, "vllm_reset_weights")
        return {"status": "reset"}
    if action == "compare" and not isinstance(baseline, dict):
        raise bad_request("action='compare' requires a 'baseline' object", "baseline")
    checksums = await _checksums(state)
    if action == "checksum":
        return {"checksums": checksums}
    mismatches = sorted(k for k in checksums.keys() | baseline.keys() if checksums.get(k) != baseline.get(k))
    return {"match": not mismatches, "mismatches": mismatches}


_INTERNAL_ID = re.compile(r"^(?:cmpl|chatcmpl)-(.+)-(\d+)$")


def with_external_ids(ids: list[str]) -> list[str]:
    """/abort_requests ids as given plus, for vLLM's internal form cmpl-<id>-<n>, the id inside it."""
    out = list(ids)
    for rid in ids:
        match = _INTERNAL_ID.match(rid)
        if match:
            out += [match.group(1), rid.rsplit("-", 1)[0]]
    return out


# ---- sleep mode (engine/sleep.py) ---------------------------------------------------------------


def _sleep_engines(state: ServerState) -> list[Any]:
    if not in_process(state):
        raise APIError(400, "sleep mode needs the engine in its own process (the default engine.core_process)")
    return _engines(state)


async def _on_all(state: ServerState, op: str, *args: Any) -> list[Any]:
    try:
        return list(await asyncio.gather(*(e.control(op, *args) for e in _sleep_engines(state))))
    except ValueError as exc:
        raise APIError(400, str(exc)) from None
    except EngineDeadError:
        raise
    except RuntimeError as exc:
        raise APIError(409, str(exc)) from None


@router.post("/sleep")
async def sleep(request: Request) -> dict:
    """vLLM's ?level=0|1|2 (default 1) and ?mode=abort: pause, abort in-flight requests, free the KV cache."""
    state, level = request.app.state.rlserve, request.query_params.get("level", "1")
    if level not in ("0", "1", "2"):
        raise bad_request(f"level must be 0, 1 or 2, got {level!r}", "level")
    await _on_all(state, "sleep", int(level), request.query_params.get("mode", "abort"))
    if level == "2":  # the weights are gone: resending the last weight_dir must load it, not be a no-op
        state.last_update = None
    await state.engine.refresh()
    return {"status": "sleeping", "level": int(level)}


@router.post("/release_kv_cache_memory")
async def release_kv_cache_memory(request: Request) -> dict:
    state = request.app.state.rlserve
    await _on_all(state, "release_kv_cache")
    await state.engine.refresh()
    return {"status": "kv_cache_released"}


@router.post("/wake_up")
async def wake_up(request: Request) -> dict:
    state = request.app.state.rlserve
    tags = request.query_params.getlist("tags") or None
    unknown = sorted(set(tags or ()) - {"weights", "kv_cache"})
    if unknown:
        raise bad_request(f"unknown tags {unknown}: use weights and/or kv_cache", "tags")
    awake = all(await _on_all(state, "wake_up", tags))
    await state.engine.refresh()
    return {"status": "awake" if awake else "sleeping", "tags": tags}


@router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": any(await _on_all(request.app.state.rlserve, "is_sleeping"))}


# ---- /collective_rpc: a named allow-list, never an arbitrary method ---------------------------------

RPC_METHODS = ("reload_weights", "reset_prefix_cache", "compute_weight_checksums", "reset_weights")


@router.post("/collective_rpc")
async def collective_rpc(request: Request) -> dict:
    """vLLM runs any worker method named here; rlserve runs only RPC_METHODS, one result per engine."""
    state, body = request.app.state.rlserve, await json_body(request)
    method = body.get("method")
    if method not in RPC_METHODS:
        raise bad_request(
            f"method {method!r} is not allowed; collective_rpc runs only: {', '.join(RPC_METHODS)}", "method"
        )
    if body.get("args") or body.get("kwargs"):
        raise bad_request(f"{method} takes no args or kwargs", "args")
    engines = _engines(state)
    if method == "reload_weights":  # the checkpoint this server started from, as a weight update
        model_dir = str(state.engine.model_dir)
        try:
            await state.engine.update_weights_from_dir(model_dir, [model_dir])
        except EngineDeadError:
            raise
        except RuntimeError as exc:  # the weights released by /sleep level 2 and not woken
            raise APIError(409, str(exc)) from None
        return {"results": [None] * len(engines)}
    if method == "reset_prefix_cache":
        return {"results": [bool(await state.engine.reset_prefix_cache())] * len(engines)}
    if not in_process(state):
        raise APIError(
            400, f"{method} needs the engine in its own process (the default engine.core_process)", param="method"
        )
    if method == "reset_weights":
        await on_engines(state, "vllm_reset_weights")
        return {"results": [None] * len(engines)}
    return {"results": [await e.control("vllm_checksums", f"dp{i}:pp0:pcp0:tp0:") for i, e in enumerate(engines)]}
