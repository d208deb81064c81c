"""vLLM's weight-transfer routes as TRL's VLLMClient calls them (docs/protocols.md §2.11.5):
/server_info, /init_weight_transfer_engine, /start_weight_update, /update_weights {"update_info"},
/finish_weight_update.

The trainer is rank 0 of a torch.distributed group (gloo on CPU, NCCL on CUDA) that it hosts at
master_address:master_port; this server joins as rank rank_offset. Tensors arrive in vLLM's
stream layout (packed chunks or one broadcast per tensor) and are described by the HTTP call,
never by pickled bytes. vLLM's own trainer helper rendezvouses through a StatelessProcessGroup
instead, so a trainer on rlserve joins with torch.distributed (rlserve.weight_transfer.init_group).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import torch
from fastapi import APIRouter, Request

from rlserve import weight_transfer
from rlserve.engine.weights import StagedWeights, WeightUpdateError, stage, void_update
from rlserve.server.errors import APIError, bad_request
from rlserve.server.openapi import documented
from rlserve.server.rl import vllm_rl
from rlserve.server.rl.protocol_control import FinishWeightUpdateRequest
from rlserve.server.state import ServerState, json_body

router = APIRouter()


@dataclass
class Transfer:
    """One server's side of the group and of the update being received."""

    joined: bool = False
    open: bool = False  # between /start_weight_update and /finish_weight_update
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    packed: bool = True  # init_info's packed and packed_buffer_size_bytes (vLLM >= 0.28 sends them there)
    buffer_bytes: int = weight_transfer.VLLM_PACKED_BUFFER_BYTES
    inflight: str | None = None  # the open update's in-flight policy, applied at its commit
    void: str | None = None  # why the open update lost a part: its finish commits nothing
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


def _transfer(request: Request) -> Transfer:
    if not hasattr(request.app.state, "vllm_transfer"):
        request.app.state.vllm_transfer = Transfer()
    return request.app.state.vllm_transfer


def _local_engine(state: ServerState):
    """The in-thread engine: vLLM's transfer receives into this process, so it needs the engine here."""
    engine = getattr(state.engine, "engine", None)
    if engine is None:
        raise APIError(
            400,
            "vLLM's update_info weight transfer needs the in-thread engine: start the server with "
            "--engine.core_process false, or push weights with /init_broadcaster and WeightBroadcaster",
            param="update_info",
        )
    return engine


def _backend(state: ServerState) -> str:
    engine = getattr(state.engine, "engine", None)
    if engine is not None:
        return "nccl" if engine.device.type == "cuda" else "gloo"
    return "nccl" if torch.cuda.is_available() and state.config.model.device != "cpu" else "gloo"


@router.get("/server_info")
async def server_info(request: Request) -> dict:
    """The subset of vLLM's resolved config that clients read (TRL: weight_transfer_config)."""
    state = _state(request)
    return {
        "vllm_config": {
            "model_config": {
                "model": state.served_model_name,
                "max_model_len": state.max_model_len,
                "dtype": str(
                    getattr(getattr(state.engine, "engine", None), "dtype", state.config.model.dtype)
                ).removeprefix("torch."),
            },
            "parallel_config": {
                "tensor_parallel_size": state.config.parallel.tp,
                "pipeline_parallel_size": 1,
                "data_parallel_size": state.config.parallel.dp,
            },
            "weight_transfer_config": {"backend": _backend(state), "rendezvous": "torch.distributed"},
        }
    }


@router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict:
    """Join the trainer's group; returns once the rendezvous is complete."""
    body, transfer = await json_body(request), _transfer(request)
    info = body.get("init_info")
    if not isinstance(info, dict):
        raise bad_request(
            "init_weight_transfer_engine needs init_info {master_address, master_port, rank_offset, world_size}",
            "init_info",
        )
    missing = [k for k in ("master_address", "master_port", "rank_offset", "world_size") if k not in info]
    if missing:
        raise bad_request(f"init_info is missing {', '.join(missing)}", "init_info")
    try:
        host, port = str(info["master_address"]), int(info["master_port"])
        rank, world = int(info["rank_offset"]), int(info["world_size"])
        timeout = float(info.get("timeout", 300))
    except (TypeError, ValueError) as exc:
        raise bad_request(f"init_info has a field of the wrong type: {exc}", "init_info") from None
    if not 0 < rank < world:
        raise bad_request(f"rank_offset {rank} must lie in [1, world_size {world}): the trainer is rank 0", "init_info")
    if vllm_rl.in_process(state := _state(request)):
        await vllm_rl.init(state, host, port, rank, world, timeout, vllm_rl.packed_fields(info, "init_info"))
        return {"message": "Weight transfer initialized"}
    if transfer.joined or torch.distributed.is_initialized():
        raise APIError(409, "this server already joined a weight-transfer group; restart it to join another")
    packed, buffer_bytes = vllm_rl.packed_fields(info, "init_info")
    transfer.packed = True if packed is None else packed
    transfer.buffer_bytes = buffer_bytes or weight_transfer.VLLM_PACKED_BUFFER_BYTES
    try:
        await asyncio.to_thread(weight_transfer.init_group, host, port, rank, world, timeout)
    except (RuntimeError, ValueError) as exc:
        raise APIError(504, f"the weight-transfer rendezvous at {host}:{port} failed: {exc}") from None
    transfer.joined = True
    return {"message": "Weight transfer initialized"}


@router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict:
    if vllm_rl.in_process(state := _state(request)):
        await vllm_rl.on_engines(state, "vllm_start")
        return {"message": "Weight update started"}
    transfer = _transfer(request)
    transfer.open, transfer.staged, transfer.inflight, transfer.void = True, {}, None, None
    return {"message": "Weight update started"}


async def receive_update(request: Request, info: dict, label: str | None, inflight: str | None = None) -> dict:
    """/update_weights {"update_info"}: receive the listed tensors; without an open update, also commit.
    `inflight`: the policy for the requests in flight at the commit (within an open update: at its finish)."""
    state, transfer = _state(request), _transfer(request)
    if vllm_rl.in_process(state):
        return await vllm_rl.receive(state, info, label, inflight)
    if not transfer.joined:
        raise APIError(409, "no weight-transfer group: call /init_weight_transfer_engine first")
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
    dtypes = []
    for d in dtype_names:
        dtype = getattr(torch, str(d).removeprefix("torch."), None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise bad_request(f"dtype {d!r} cannot carry weights; use float32, bfloat16 or float16", "update_info")
        dtypes.append(dtype)
    packed, buffer_bytes = vllm_rl.packed_fields(info, "update_info")
    packed = transfer.packed if packed is None else packed
    buffer_bytes = buffer_bytes or transfer.buffer_bytes
    device = "cuda" if _local_engine(state).device.type == "cuda" else "cpu"
    async with transfer.lock:
        try:
            # receive everything first so the group stays in step with the trainer, then validate
            received = await asyncio.to_thread(
                weight_transfer.receive_vllm,
                [str(n) for n in names],
                dtypes,
                [list(s) for s in shapes],
                packed,
                buffer_bytes,
                device,
            )
            staged = stage(_local_engine(state).model, received, "update_info", require_all=False)
        except BaseException as exc:
            if transfer.open:  # the tensors staged before this part must not go live without it
                transfer.void, transfer.staged, transfer.inflight = str(exc) or type(exc).__name__, {}, None
            if isinstance(exc, WeightUpdateError):
                raise bad_request(f"{exc}; the previous weights keep serving", "update_info") from None
            raise
        transfer.staged.update(staged.tensors)
        if transfer.open:
            transfer.inflight = inflight or transfer.inflight
            return {"message": "Weights updated"}
        version = await _commit(state, transfer, label, inflight)
    return {"message": "Weights updated", "policy_version": version}


@router.post("/finish_weight_update", openapi_extra=documented(FinishWeightUpdateRequest))
async def finish_weight_update(request: Request) -> dict:
    """The commit point: every tensor received since /start_weight_update goes live at once."""
    state, transfer = _state(request), _transfer(request)
    body = await json_body(request, FinishWeightUpdateRequest)
    label = None if body.get("weight_version") is None else str(body["weight_version"])
    inflight = body.get("inflight_update_policy")
    if vllm_rl.in_process(state):
        version = await vllm_rl.finish(state, label, inflight)
        return {"message": "Weight update finished", "policy_version": version}
    async with transfer.lock:
        transfer.open, inflight, transfer.inflight = False, inflight or transfer.inflight, None
        if transfer.void is not None:
            why, transfer.void, transfer.staged = transfer.void, None, {}
            engine = state.engine
            raise APIError(409, void_update(why, engine.policy_version, engine.weight_version))
        if not transfer.staged:
            return {"message": "Weight update finished", "policy_version": state.engine.policy_version}
        version = await _commit(state, transfer, label, inflight)
    return {"message": "Weight update finished", "policy_version": version}


async def _commit(state: ServerState, transfer: Transfer, label: str | None, inflight: str | None) -> int:
    staged, transfer.staged = StagedWeights(transfer.staged, "update_info"), {}
    return await state.engine.call(lambda e: e.commit_weights(staged, label, inflight))


def leave(request: Request) -> None:
    """/shutdown_weight_transfer_engine with the in-thread engine: drop the group, so another trainer can join."""
    transfer = _transfer(request)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    transfer.joined, transfer.open, transfer.staged = False, False, {}


@router.post("/shutdown_weight_transfer_engine")
async def shutdown_weight_transfer_engine(request: Request) -> dict:
    """Leave the trainer's group, so that another trainer can join."""
    state = request.app.state.rlserve
    if vllm_rl.in_process(state):
        await vllm_rl.on_engines(state, "vllm_shutdown")
    else:
        leave(request)
    return {"message": "Weight transfer shut down"}
