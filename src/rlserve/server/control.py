"""Control plane (wire-protocols §2.11): weight updates, pause/resume, aborts, prefix cache, LoRA adapters.

Every mutation runs between two engine steps (AsyncEngine.call), so no forward pass mixes weights;
each committed one bumps policy_version and the prefix-cache generation.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from rlserve.engine.weights import WeightUpdateError, check_under_roots
from rlserve.model.lora import AdapterError, load_peft_adapter
from rlserve.server.errors import APIError, bad_request
from rlserve.server.openapi import documented
from rlserve.server.protocol_control import (
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
from rlserve.server.serving import ServerState, json_body

router = APIRouter()

# routes that need server.admin_api_key when it is set
ADMIN_PATHS = frozenset({
    "/update_weights", "/init_broadcaster", "/pause", "/resume", "/abort_requests", "/reset_prefix_cache",
    "/load_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/load_adapter", "/upload_adapter",
    "/update_weights_from_disk", "/pause_generation", "/continue_generation", "/flush_cache", "/abort_request",
    "/update_weight_version",
})


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


def _under_roots(state: ServerState, path: str, field: str) -> Path:
    try:
        return check_under_roots(path, state.config.weight_roots)
    except PermissionError as exc:
        raise APIError(403, str(exc), param=field) from None


async def _update_from_dir(state: ServerState, weight_dir: str, field: str, label: str | None) -> int:
    path = _under_roots(state, weight_dir, field)
    if not path.is_dir():
        raise APIError(404, f"{field} {weight_dir!r} does not exist", param=field)
    # trainers retry updates on timeouts: the same unchanged directory again is a no-op
    fingerprint = (str(path), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(path.glob("*"))))
    engine = state.engine.engine
    if state.last_update == (fingerprint, engine.policy_version):
        return engine.policy_version
    try:
        version = await state.engine.update_weights_from_dir(str(path), state.config.weight_roots, label)
    except WeightUpdateError as exc:
        raise bad_request(f"{exc}; the previous weights keep serving", field) from None
    state.last_update = (fingerprint, version)
    return version


def _label(body: dict) -> str | None:
    label = body.get("weight_version")
    return None if label is None else str(label)


@router.post("/update_weights", openapi_extra=documented(UpdateWeightsRequest))
async def update_weights(request: Request) -> dict:
    """prime-rl {"weight_dir"} (null = receive a trainer push), NexRL {"weight_path"}; §2.0 dispatch."""
    state, body = _state(request), await json_body(request, UpdateWeightsRequest)
    if "update_info" in body:
        raise bad_request("vLLM's update_info weight transfer is not supported; use /init_broadcaster", "update_info")
    if "weight_path" in body:
        path = Path(str(body["weight_path"]))
        if (path / "adapter_config.json").exists():
            version = await _load_adapter(state, str(body.get("model_name") or path.name), str(path), "weight_path")
        else:
            version = await _update_from_dir(state, str(path), "weight_path", _label(body))
        return {"status": "ok", "policy_version": version}
    if body.get("weight_dir") is None:
        try:
            version = await state.engine.update_weights_from_broadcast(_label(body))
        except RuntimeError as exc:
            raise APIError(409, str(exc)) from None
        except WeightUpdateError as exc:
            raise bad_request(f"{exc}; the previous weights keep serving") from None
        return {"status": "ok", "policy_version": version}
    version = await _update_from_dir(state, str(body["weight_dir"]), "weight_dir", _label(body))
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


_PAUSE_QUERY = {"parameters": [
    {"name": "mode", "in": "query", "required": False, "schema": {"enum": ["keep", "abort", "wait"]}},
    {"name": "wait_for_inflight_requests", "in": "query", "required": False, "schema": {"type": "boolean"}},
    {"name": "clear_cache", "in": "query", "required": False, "schema": {"type": "boolean"}},
]}


@router.post("/pause", openapi_extra=_PAUSE_QUERY)
async def pause(request: Request) -> dict:
    mode = request.query_params.get("mode")
    wait_flag = request.query_params.get("wait_for_inflight_requests")
    if mode is None and wait_flag is not None:  # vLLM 0.14 form
        mode = "wait" if wait_flag.lower() == "true" else "abort"
    mode = mode or "keep"
    if mode not in ("keep", "abort", "wait"):
        raise bad_request(f"mode must be keep, abort or wait, got {mode!r}", "mode")
    aborted = await _state(request).engine.pause(mode)
    if request.query_params.get("clear_cache", "false").lower() == "true":
        await _state(request).engine.call(lambda e: e.pool.reset_prefix_cache())
    return {"status": "paused", "aborted": aborted} if mode == "abort" else {"status": "paused"}


@router.post("/resume")
async def resume(request: Request) -> dict:
    await _state(request).engine.resume()
    return {"status": "resumed"}


@router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": _state(request).engine.paused}


@router.post("/abort_requests", openapi_extra=documented(AbortRequestsRequest))
async def abort_requests(request: Request) -> dict:
    body = await json_body(request, AbortRequestsRequest)
    ids = body.get("request_ids") or []
    engine = _state(request).engine
    if not ids:
        count = await engine.call(lambda e: e.abort_all())
    else:
        count = await engine.call(lambda e: sum(e.abort(str(i)) for i in ids))
    return {"status": "aborted", "aborted": count}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request) -> dict:
    ok = await _state(request).engine.call(lambda e: e.pool.reset_prefix_cache())
    message = "prefix cache reset" if ok else "blocks still referenced by running requests were kept"
    return {"success": ok, "message": message}


# ---- LoRA adapters (§2.11.1) --------------------------------------------------------------------


async def _load_adapter(state: ServerState, name: str, path: str, field: str) -> int:
    resolved = _under_roots(state, path, field)
    engine = state.engine.engine
    try:
        adapter = await asyncio.to_thread(load_peft_adapter, name, resolved, engine.shape, engine.dtype, engine.device)
    except FileNotFoundError as exc:
        raise APIError(404, str(exc), param=field) from None
    except AdapterError as exc:
        raise bad_request(str(exc), field) from None
    return await state.engine.call(lambda e: e.add_adapter(adapter))


def _name_and_path(body: dict) -> tuple[str, str]:
    name, path = body.get("lora_name"), body.get("lora_path")
    if not name or not path:
        raise bad_request("lora_name and lora_path are required", "lora_name" if not name else "lora_path")
    return str(name), str(path)


@router.post("/v1/load_lora_adapter", openapi_extra=documented(LoraAdapterRequest))
async def load_lora_adapter_v1(request: Request) -> PlainTextResponse:
    state, body = _state(request), await json_body(request, LoraAdapterRequest)
    name, path = _name_and_path(body)
    if name in state.engine.engine.adapters and not body.get("load_inplace", False):
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
    if name not in state.engine.engine.adapters:
        raise APIError(404, f"adapter {name!r} is not loaded", param="lora_name")
    await state.engine.call(lambda e: e.remove_adapter(name))
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


@router.post("/upload_adapter")
async def upload_adapter(request: Request) -> dict:
    """Multipart `adapter_weights` (MLX layout: lora_a [in, r], lora_b [r, out]) + `adapter_config`."""
    state = _state(request)
    form = await request.form()
    weights, config = form.get("adapter_weights"), form.get("adapter_config")
    if weights is None or config is None or isinstance(weights, str) or isinstance(config, str):
        raise bad_request("upload adapter_weights and adapter_config as multipart files")
    root = Path(state.config.weight_roots[0]).resolve() / ".rlserve-uploads"
    root.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(dir=root))
    try:
        from rlserve.model.mlx_adapter import convert_mlx_adapter

        try:
            convert_mlx_adapter(await weights.read(), await config.read(), target, state.engine.engine.shape)
        except (ValueError, KeyError) as exc:
            raise bad_request(f"invalid MLX adapter: {exc}") from None
        version = await _activate(state, str(target))
    finally:
        shutil.rmtree(target, ignore_errors=True)
    return {"status": "success", "policy_version": version, "message": "adapter uploaded and loaded"}


# ---- SGLang and TRL aliases (§2.11.4, §2.11.6) -------------------------------------------------


@router.get("/get_world_size")
async def get_world_size() -> dict:
    return {"world_size": 1}


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict:
    engine = _state(request).engine.engine
    return {"model_path": str(engine.model_dir), "tokenizer_path": str(engine.model_dir), "is_generation": True,
            "weight_version": engine.weight_version, "policy_version": engine.policy_version}


@router.get("/get_weight_version")
async def get_weight_version(request: Request) -> dict:
    engine = _state(request).engine.engine
    return {"weight_version": engine.weight_version, "policy_version": engine.policy_version}


@router.post("/update_weight_version", openapi_extra=documented(UpdateWeightVersionRequest))
async def update_weight_version(request: Request) -> dict:
    """Relabel the current weights; aborts in-flight requests only when asked (§2.15)."""
    body = await json_body(request, UpdateWeightVersionRequest)
    label = body.get("new_version", body.get("weight_version"))
    if label is None:
        raise bad_request("new_version is required", "new_version")
    engine = _state(request).engine

    def relabel(e) -> None:
        if body.get("abort_all_requests", False):
            e.abort_all()
        e.weight_version = str(label)

    await engine.call(relabel)
    return {"success": True, "message": f"weight_version is now {label}"}


@router.post("/update_weights_from_disk", openapi_extra=documented(UpdateWeightsFromDiskRequest))
async def update_weights_from_disk(request: Request) -> dict:
    state, body = _state(request), await json_body(request, UpdateWeightsFromDiskRequest)
    if not body.get("model_path"):
        raise bad_request("model_path is required", "model_path")
    aborted = await state.engine.call(lambda e: e.abort_all()) if body.get("abort_all_requests") else 0
    version = await _update_from_dir(state, str(body["model_path"]), "model_path", _label(body))
    return {"success": True, "message": f"weights updated (policy_version {version})", "num_paused_requests": aborted}


@router.post("/abort_request", openapi_extra=documented(AbortRequest))
async def abort_request(request: Request) -> Response:
    body = await json_body(request, AbortRequest)
    engine = _state(request).engine
    if body.get("abort_all"):
        await engine.call(lambda e: e.abort_all())
    elif body.get("rid") is not None:
        await engine.call(lambda e: e.abort(str(body["rid"])))
    return Response(status_code=200)


@router.get("/flush_cache")
@router.post("/flush_cache")
async def flush_cache(request: Request) -> PlainTextResponse:
    await _state(request).engine.call(lambda e: e.pool.reset_prefix_cache())
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
