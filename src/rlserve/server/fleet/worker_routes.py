"""What vllm-router asks of a worker (docs/protocols.md §1, §1.1): load for power_of_two, server info, a
generation-backed health check, and the render routes that let cache_aware see token ids."""

from __future__ import annotations

import importlib.metadata
import uuid
from typing import Any

from fastapi import APIRouter, Request

from rlserve.engine.params import SamplingParams
from rlserve.server.errors import APIError
from rlserve.server.openai import chat, completions
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import SAMPLING_FIELDS, ServerState

router = APIRouter()


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


@router.get("/get_load")
@router.get("/load")
async def get_load(request: Request) -> dict:
    stats = _state(request).engine.stats
    return {
        "load": stats.num_running + stats.num_waiting,
        "server_load": stats.num_running + stats.num_waiting,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
    }


@router.get("/get_server_info")
async def get_server_info(request: Request) -> dict:
    state = _state(request)
    engine = state.engine
    return {
        "model_path": str(engine.model_dir),
        "served_model_name": state.served_model_name,
        "max_model_len": state.max_model_len,
        "max_num_seqs": state.config.engine.max_num_seqs,
        "policy_version": engine.policy_version,
        "weight_version": engine.weight_version,
        "is_paused": state.engine.paused,
        "version": importlib.metadata.version("rlserve"),
    }


@router.get("/health_generate")
async def health_generate(request: Request) -> dict:
    """200 once a one-token generation went through the engine; at once while paused (it would wait)."""
    state = _state(request)
    if state.engine.dead is not None:
        raise APIError(503, f"engine loop died: {state.engine.dead!r}")
    if not state.engine.paused:
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in state.engine.generate([0], params, f"health-{uuid.uuid4().hex}", stream=False):
            pass
    return {"status": "healthy"}


def _sampling_fields(body: Any) -> dict[str, Any]:
    fields = body.model_dump(exclude_unset=True) | (body.model_extra or {})
    return {k: v for k, v in fields.items() if k in SAMPLING_FIELDS and k != "prompt"}


def _generate_request(body: Any, token_ids: list[int], rid: str) -> dict[str, Any]:
    """The /inference/v1/generate body that would produce this request's completion."""
    return {
        "request_id": rid,
        "token_ids": token_ids,
        "sampling_params": _sampling_fields(body),
        "model": body.model,
        "stream": bool(body.stream),
        "cache_salt": body.cache_salt,
        "features": None,
    }


@router.post("/v1/completions/render")
async def render_completion(body: CompletionRequest, request: Request) -> list[dict]:
    state = _state(request)
    state.check_model(body.model)
    prompts, _ = await state.off_loop(completions._prompts, state, body)  # tokenizing off the event loop
    rid = uuid.uuid4().hex
    return [_generate_request(body, ids, f"{rid}-{i}") for i, ids in enumerate(prompts)]


@router.post("/v1/chat/completions/render")
async def render_chat(body: ChatCompletionRequest, request: Request) -> list[dict]:
    state = _state(request)
    ctx = await chat.prepare(state, body, uuid.uuid4().hex)
    return [_generate_request(body, ctx.prompt, ctx.rid)]
