"""GET /v1/responses/{id}: the last finished, non-streamed responses, kept in a bounded store (oldest out
first), as vLLM keeps them when `store` is not false. A streamed response is not kept."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from fastapi import APIRouter, Request

from rlserve.server.errors import APIError

router = APIRouter()
CAPACITY = 1024  # responses kept; a rollout worker reads its answer back soon after, or not at all


def _store(request: Request) -> OrderedDict[str, dict]:
    if not hasattr(request.app.state, "responses_store"):
        request.app.state.responses_store = OrderedDict()
    return request.app.state.responses_store


def remember(request: Request, body: Any, payload: dict) -> dict:
    """Keep `payload` under its id unless the request said store: false; returns it unchanged."""
    extra = getattr(body, "model_extra", None) or {}
    if extra.get("store", True) is not False and isinstance(payload.get("id"), str):
        store = _store(request)
        store[payload["id"]] = payload
        while len(store) > CAPACITY:
            store.popitem(last=False)
    return payload


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> dict:
    payload = _store(request).get(response_id)
    if payload is None:
        raise APIError(
            404,
            f"response {response_id!r} is not stored: only the last {CAPACITY} non-streamed "
            "responses created with store not false are kept",
            param="response_id",
        )
    return payload
