"""Control plane (docs/protocols.md §2.11): weight updates, pause/resume, aborts, prefix cache, LoRA adapters.

Every mutation is a named engine operation that runs between two engine steps (in the engine
process, or the engine thread), so no forward pass mixes weights; each committed one bumps
policy_version and the prefix-cache generation.
"""

from __future__ import annotations

import asyncio
import logging
import re
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from rlserve.engine.weights import WeightUpdateError, check_under_roots
from rlserve.model.lora import AdapterError
from rlserve.runtime.face import EngineDeadError
from rlserve.server.errors import APIError, bad_request
from rlserve.server.openapi import documented
from rlserve.server.rl import vllm_rl
from rlserve.server.rl import weights as vllm_weights
from rlserve.server.rl.protocol_control import (
    AbortRequest,
    AbortRequestsRequest,
    InitBroadcasterRequest,
    LoadAdapterRequest,
    LoraAdapterRequest,
    PauseGenerationRequest,
    UnloadLoraAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsRequest,
    UpdateWeightVersionRequest,
)
from rlserve.server.rl.uploads import capped, write_uploaded_adapter
from rlserve.server.state import ServerState, json_body
from rlserve.server.streaming import ClientGone, until_disconnected

log = logging.getLogger(__name__)
router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


def _under_roots(state: ServerState, path: str, field: str) -> Path:
    try:
        return check_under_roots(path, state.config.weight_roots)
    except PermissionError as exc:
        raise APIError(403, str(exc), param=field) from None


async def _update_from_dir(
    request: Request, state: ServerState, weight_dir: str, field: str, label: str | None, inflight: str | None = None
) -> int:
    path = _under_roots(state, weight_dir, field)
    if not path.is_dir():
        raise APIError(404, f"{field} {weight_dir!r} does not exist", param=field)
    # trainers retry updates on timeouts: the same unchanged directory under the same label is a no-op
    engine = state.engine
    fingerprint = _fingerprint(path)
    if state.last_update == (fingerprint, engine.policy_version) and label in (None, engine.weight_version):
        return engine.policy_version
    try:
        version = await _unless_abandoned(
            request,
            lambda started: state.engine.update_weights_from_dir(
                str(path), state.config.weight_roots, label, started, inflight
            ),
        )
    except PermissionError as exc:
        raise APIError(403, str(exc), param=field) from None
    except WeightUpdateError as exc:
        raise bad_request(f"{exc}; the previous weights keep serving", field) from None
    except EngineDeadError:
        raise
    except RuntimeError as exc:  # the weights released by /sleep level 2 and not woken
        raise APIError(409, str(exc)) from None
    state.last_update = (fingerprint, version)
    return version


def _fingerprint(path: Path) -> tuple:
    entries = []
    for f in sorted(path.iterdir()):
        try:
            info = f.stat()
        except OSError:  # a broken symlink: the update itself says what is wrong
            info = f.lstat()
        entries.append((f.name, info.st_size, info.st_mtime_ns))
    return str(path), tuple(entries)


async def _unless_abandoned(request: Request, update: Callable[[asyncio.Event], Awaitable[int]]) -> int:
    """Run a weight update; if its caller disconnects while it still waits for an earlier update, it
    is dropped and never applied. Once it holds the update lock it runs to the end, and its caller
    can read the outcome from GET /get_weight_version."""
    started = asyncio.Event()
    task = asyncio.ensure_future(update(started))
    try:
        return await until_disconnected(request, asyncio.shield(task))
    except ClientGone:
        if not started.is_set():
            task.cancel()
            log.warning("weight update dropped: its caller left before it started")
        else:
            log.warning("weight update goes on without its caller; GET /get_weight_version reports the outcome")
            _background.add(task)
            task.add_done_callback(_background.discard)
        raise APIError(499, "the caller disconnected", type="ClientClosedRequest") from None


_background: set[asyncio.Task] = set()  # updates whose callers left mid-way: keep a reference until done


def _label(body: dict) -> str | None:
    label = body.get("weight_version")
    return None if label is None else str(label)


@router.post("/update_weights", openapi_extra=documented(UpdateWeightsRequest))
async def update_weights(request: Request) -> dict:
    """prime-rl {"weight_dir"} (null = receive a trainer push), NexRL {"weight_path"}, vLLM
    {"update_info"} (vllm_weights); §2.0 dispatch."""
    state, body = _state(request), await json_body(request, UpdateWeightsRequest)
    inflight = body.get("inflight_update_policy")
    if "update_info" in body:
        if not isinstance(body["update_info"], dict):
            raise bad_request("update_info must be an object {names, dtype_names, shapes}", "update_info")
        return await vllm_weights.receive_update(request, body["update_info"], _label(body), inflight)
    if "weight_path" in body:
        path = Path(str(body["weight_path"]))
        if (path / "adapter_config.json").exists():
            version = await _load_adapter(state, str(body.get("model_name") or path.name), str(path), "weight_path")
        else:
            version = await _update_from_dir(request, state, str(path), "weight_path", _label(body), inflight)
        return {"status": "ok", "policy_version": version}
    if body.get("weight_dir") is None:
        try:
            label = _label(body)
            version = await _unless_abandoned(
                request, lambda started: state.engine.update_weights_from_broadcast(label, started, inflight)
            )
        except RuntimeError as exc:
            raise APIError(409, str(exc)) from None
        except WeightUpdateError as exc:
            raise bad_request(f"{exc}; the previous weights keep serving") from None
        return {"status": "ok", "policy_version": version}
    version = await _update_from_dir(request, state, str(body["weight_dir"]), "weight_dir", _label(body), inflight)
    return {"status": "ok", "policy_version": version}


@router.post("/init_broadcaster", openapi_extra=documented(InitBroadcasterRequest))
async def init_broadcaster(request: Request) -> dict:
    state, body = _state(request), await json_body(request, InitBroadcasterRequest)
    try:
        host, port = str(body["host"]), int(body["port"])
        rank = int(body.get("rank_offset", 0)) + 1
        world = int(body.get("inference_world_size", 1)) + 1
        timeout = float(body.get("timeout", 300))
    except (KeyError, TypeError, ValueError) as exc:
        raise bad_request(f"init_broadcaster needs host, port, rank_offset, inference_world_size ({exc})") from None
    try:
        await state.engine.init_broadcaster(host, port, rank, world, timeout)
    except RuntimeError as exc:
        raise APIError(409, str(exc)) from None
    return {"status": "ok"}


_PAUSE_QUERY = {
    "parameters": [
        {"name": "mode", "in": "query", "required": False, "schema": {"enum": ["keep", "abort", "wait"]}},
        {"name": "wait_for_inflight_requests", "in": "query", "required": False, "schema": {"type": "boolean"}},
        {"name": "clear_cache", "in": "query", "required": False, "schema": {"type": "boolean"}},
    ]
}


@router.post("/pause", openapi_extra=_PAUSE_QUERY)
async def pause(request: Request) -> dict:
    mode = request.query_params.get("mode")
    wait_flag = request.query_params.get("wait_for_inflight_requests")
    if mode is None and wait_flag is not None:  # vLLM 0.14 form
        mode = "wait" if wait_flag.lower() == "true" else "abort"
    mode = mode or "abort"  # vLLM 0.32's default: abort in-flight requests, then clear the prefix cache
    if mode not in ("keep", "abort", "wait"):
        raise bad_request(f"mode must be keep, abort or wait, got {mode!r}", "mode")
    aborted = await _state(request).engine.pause(mode)
    clear = request.query_params.get("clear_cache", "false" if mode == "keep" else "true").lower() == "true"
    if clear:  # by default not with keep: the frozen requests resume on their cached blocks
        await _state(request).engine.reset_prefix_cache()
    return {"status": "paused", "aborted": aborted} if mode == "abort" else {"status": "paused"}


_RESUME_QUERY = {
    "parameters": [
        {
            "name": "steps",
            "in": "query",
            "required": False,
            "description": "run this many engine steps, then freeze again as pause(mode=keep) does; "
            "the reply comes once they have run",
            "schema": {"type": "integer", "minimum": 1},
        }
    ]
}


@router.post("/resume", openapi_extra=_RESUME_QUERY)
async def resume(request: Request) -> dict:
    raw = request.query_params.get("steps")
    steps = None
    if raw is not None:
        if not re.fullmatch(r"[0-9]{1,18}", raw) or int(raw) < 1:
            raise bad_request(f"steps must be a whole number of at least 1, got {raw!r}", "steps")
        steps = int(raw)
    try:
        await _state(request).engine.resume(steps)
    except EngineDeadError:
        raise
    except RuntimeError as exc:  # asleep (vllm_rl /sleep): /wake_up first
        raise APIError(409, str(exc)) from None
    return {"status": "resumed"} if steps is None else {"status": "paused", "steps": steps}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": _state(request).engine.paused}


@router.post("/abort_requests", openapi_extra=documented(AbortRequestsRequest))
async def abort_requests(request: Request) -> dict:
    body = await json_body(request, AbortRequestsRequest)
    ids = vllm_rl.with_external_ids([str(i) for i in body.get("request_ids") or []])
    count = await _state(request).engine.abort_requests([str(i) for i in ids] if ids else None)
    return {"status": "aborted", "aborted": count}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    ok = await _state(request).engine.reset_prefix_cache()
    message = "prefix cache reset" if ok else "blocks still referenced by running requests were kept"
    return {"success": ok, "message": message}


# ---- LoRA adapters (§2.11.1) --------------------------------------------------------------------


async def _load_adapter(state: ServerState, name: str, path: str, field: str) -> int:
    resolved = _under_roots(state, path, field)
    return await _add_adapter(state, name, resolved, field, state.config.weight_roots)


async def _add_adapter(state: ServerState, name: str, path: Path, field: str | None, roots: list[str]) -> int:
    try:
        return await state.engine.load_adapter(name, str(path), roots)
    except PermissionError as exc:
        raise APIError(403, str(exc), param=field) from None
    except FileNotFoundError as exc:
        raise APIError(404, str(exc), param=field) from None
    except AdapterError as exc:
        raise bad_request(str(exc), field) from None


def _name_and_path(body: dict) -> tuple[str, str]:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise bad_request("lora_name and lora_path are required", "lora_name" if not name else "lora_path")
    return str(name), str(path)


@router.post("/v1/load_lora_adapter", openapi_extra=documented(LoraAdapterRequest))
async def load_lora_adapter_v1(request: Request) -> PlainTextResponse:
    state, body = _state(request), await json_body(request, LoraAdapterRequest)
    name, path = _name_and_path(body)
    if name in state.engine.adapters and not body.get("load_inplace", False):
        raise bad_request(f"adapter {name!r} is already loaded; send load_inplace=true to replace it", "lora_name")
    await _load_adapter(state, name, path, "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post("/load_lora_adapter", openapi_extra=documented(LoraAdapterRequest))
async def load_lora_adapter(request: Request) -> dict:
    """prime-rl / SGLang: always in place under the same name."""
    state, body = _state(request), await json_body(request, LoraAdapterRequest)
    name, path = _name_and_path(body)
    version = await _load_adapter(state, name, path, "lora_path")
    return {"status": "ok", "success": True, "message": f"adapter {name!r} loaded", "policy_version": version}


@router.post("/v1/unload_lora_adapter", openapi_extra=documented(UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    state, body = _state(request), await json_body(request, UnloadLoraAdapterRequest)
    name = body.get("lora_name")
    if name not in state.engine.adapters:
        raise APIError(404, f"adapter {name!r} is not loaded", param="lora_name")
    try:
        await state.engine.remove_adapter(name)
    except KeyError:  # unloaded meanwhile
        raise APIError(404, f"adapter {name!r} is not loaded", param="lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@router.post("/load_adapter", openapi_extra=documented(LoadAdapterRequest))
async def load_adapter(request: Request) -> dict:
    """MLX-style: one adapter that every request of the base model uses from now on."""
    state, body = _state(request), await json_body(request, LoadAdapterRequest)
    path = body.get("adapter_path")
    if not path:
        raise bad_request("adapter_path is required", "adapter_path")
    version = await _activate(state, str(path))
    return {"status": "success", "policy_version": version, "message": f"adapter loaded from {path}"}


async def _activate(state: ServerState, path: str) -> int:
    version = await _load_adapter(state, MLX_ADAPTER, path, "adapter_path")
    state.default_adapter = MLX_ADAPTER
    return version


MLX_ADAPTER = "mlx-adapter"


async def activate_startup_adapter(state: ServerState, path: str) -> int:
    """model.adapter_path (the MLX --adapter-path): the operator's adapter, read wherever it lies."""
    resolved = Path(path).expanduser().resolve()
    try:
        version = await _add_adapter(state, MLX_ADAPTER, resolved, "model.adapter_path", [str(resolved)])
    except APIError as exc:
        raise SystemExit(f"rlserve: error: model.adapter_path (--adapter-path): {exc.message}") from None
    state.default_adapter = MLX_ADAPTER
    return version


@router.post("/upload_adapter")
async def upload_adapter(request: Request) -> dict:
    """Multipart `adapter_weights` (safetensors) + `adapter_config` (JSON): MLX layout (lora_a [in, r],
    lora_b [r, out], `lora_parameters`) or PEFT layout (`r`, `lora_alpha`, lora_A/lora_B tensors).
    Client file names are never used as paths; nothing is unpickled; the body is capped."""
    state = _state(request)
    cap = state.config.server.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > cap:
        raise APIError(413, f"upload of {declared} bytes exceeds server.max_upload_bytes ({cap})")
    form = await capped(request, cap).form(max_files=2, max_fields=2)
    weights, config = form.get("adapter_weights"), form.get("adapter_config")
    if weights is None or config is None or isinstance(weights, str) or isinstance(config, str):
        raise bad_request("upload adapter_weights and adapter_config as multipart files")
    weights_bytes, config_bytes = await weights.read(), await config.read()
    await form.close()
    target = Path(tempfile.mkdtemp(prefix="rlserve-upload-"))
    try:
        await asyncio.to_thread(write_uploaded_adapter, weights_bytes, config_bytes, target, state.engine.shape)
        version = await _add_adapter(state, MLX_ADAPTER, target, "adapter_weights", [str(target)])
        state.default_adapter = MLX_ADAPTER
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return {"status": "success", "policy_version": version, "message": "adapter uploaded and loaded"}


# ---- SGLang and TRL aliases (§2.11.4, §2.11.6) -------------------------------------------------


@router.get("/get_world_size")
async def get_world_size(request: Request) -> dict:
    """The processes that join a trainer's weight-transfer group: one per data-parallel engine (tensor-parallel
    workers get their slices from their engine), so TRL's world_size = this + 1 is right."""
    return {"world_size": _state(request).config.parallel.dp}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict:
    engine = _state(request).engine
    return {
        "model_path": str(engine.model_dir),
        "tokenizer_path": str(engine.model_dir),
        "is_generation": True,
        "weight_version": engine.weight_version,
        "policy_version": engine.policy_version,
    }


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict:
    engine = _state(request).engine
    # updating: a weight update holds the update lock (its outcome shows here once it is false again)
    return {
        "weight_version": engine.weight_version,
        "policy_version": engine.policy_version,
        "updating": engine.updating,
    }


@router.post("/update_weight_version", openapi_extra=documented(UpdateWeightVersionRequest))
async def update_weight_version(request: Request) -> dict:
    """Relabel the current weights; aborts in-flight requests only when asked (§2.15)."""
    body = await json_body(request, UpdateWeightVersionRequest)
    label = body.get("new_version", body.get("weight_version"))
    if label is None:
        raise bad_request("new_version is required", "new_version")
    await _state(request).engine.set_weight_version(str(label), bool(body.get("abort_all_requests", False)))
    return {"success": True, "new_version": str(label), "message": f"weight_version is now {label}"}


@router.post("/update_weights_from_disk", openapi_extra=documented(UpdateWeightsFromDiskRequest))
async def update_weights_from_disk(request: Request) -> dict:
    state, body = _state(request), await json_body(request, UpdateWeightsFromDiskRequest)
    if not body.get("model_path"):
        raise bad_request("model_path is required", "model_path")
    aborted = await state.engine.abort_requests() if body.get("abort_all_requests") else 0
    version = await _update_from_dir(
        request, state, str(body["model_path"]), "model_path", _label(body), body.get("inflight_update_policy")
    )
    return {"success": True, "message": f"weights updated (policy_version {version})", "num_paused_requests": aborted}


@router.post("/abort_request", openapi_extra=documented(AbortRequest))
async def abort_request(request: Request) -> Response:
    body = await json_body(request, AbortRequest)
    engine = _state(request).engine
    if body.get("abort_all"):
        await engine.abort_requests()
    elif body.get("rid") is not None:
        await engine.abort_requests([str(body["rid"])])
    return Response(status_code=200)


@router.get("/flush_cache")
@router.post("/flush_cache")
async def flush_cache(request: Request) -> PlainTextResponse:
    await _state(request).engine.reset_prefix_cache()
    return PlainTextResponse("Cache flushed.")


@router.post("/pause_generation", openapi_extra=documented(PauseGenerationRequest))
async def pause_generation(request: Request) -> dict:
    body = await json_body(request, PauseGenerationRequest)
    mode = {"in_place": "keep", "abort": "abort", None: "abort"}.get(body.get("mode"))
    if mode is None:
        raise bad_request(f"mode {body.get('mode')!r} is not supported; use abort or in_place", "mode")
    await _state(request).engine.pause(mode)
    return {"status": "ok", "message": "Generation paused successfully."}


@router.post("/continue_generation")
async def continue_generation(request: Request) -> dict:
    await _state(request).engine.resume()
    return {"status": "ok", "message": "Generation continued successfully."}
