"""SageMaker's hosting routes as vLLM 0.32 serves them: `POST /invocations` runs a chat completion when the
body has `messages`, else a completion when it has `prompt`; `POST /ping` is the health check."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rlserve.server.errors import APIError, bad_request
from rlserve.server.openai import chat, completions
from rlserve.server.protocol import ChatCompletionRequest, CompletionRequest
from rlserve.server.state import json_body

router = APIRouter()


@router.post("/invocations")
async def invocations(request: Request) -> Response:
    body = await json_body(request)
    if "messages" in body:
        return await chat.create_chat_completion(ChatCompletionRequest.model_validate(body), request)
    if "prompt" in body:
        return await completions.create_completion(CompletionRequest.model_validate(body), request)
    raise bad_request(
        "Cannot find suitable handler for request. Expected one of: ['ChatCompletionRequest', 'CompletionRequest'] "
        "(a body with messages or with prompt)"
    )


@router.post("/ping")
async def ping(request: Request) -> dict:
    engine = request.app.state.rlserve.engine
    if engine.dead is not None:
        raise APIError(503, f"engine loop died: {engine.dead!r}")
    return {"status": "healthy", "model_loaded": True}
