"""POST /v1/chat/completions/batch (vLLM 0.32): `messages` is a list of conversations, each run as its own
chat completion with the request's other fields, concurrently; one response, one choice per conversation
(index i for conversation i), usage summed. As in vLLM: no streaming, no tools, n = 1."""

from __future__ import annotations

import asyncio
import uuid

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.server.errors import bad_request
from rlserve.server.openai import chat
from rlserve.server.protocol import ChatCompletionRequest
from rlserve.server.state import ServerState, json_body, rid_header
from rlserve.server.streaming import ClientGone, run_to_end

router = APIRouter()


def _conversations(body: dict) -> list[ChatCompletionRequest]:
    messages = body.get("messages")
    if not (isinstance(messages, list) and messages and all(isinstance(m, list) and m for m in messages)):
        raise bad_request(
            "messages must be a non-empty list of conversations, each a non-empty list of messages", "messages"
        )
    if body.get("stream"):
        raise bad_request("the batch endpoint does not stream; send stream false or use /v1/chat/completions", "stream")
    if body.get("tools"):
        raise bad_request("the batch endpoint takes no tools; use /v1/chat/completions", "tools")
    if isinstance(body.get("kv_transfer_params"), dict) and body["kv_transfer_params"].get("prompt_token_ids"):
        field = "kv_transfer_params.prompt_token_ids"
        raise bad_request(f"the batch endpoint takes no {field}: one prompt cannot serve several conversations", field)
    if body.get("n", 1) not in (1, None):
        raise bad_request("the batch endpoint needs n = 1: one choice per conversation", "n")
    try:
        return [ChatCompletionRequest.model_validate({**body, "messages": m}) for m in messages]
    except pydantic.ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err.get("loc", ()))
        raise bad_request(f"{field}: {err.get('msg')}", field or None) from None


@router.post("/v1/chat/completions/batch")
async def create_batch_chat_completion(request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    subs = _conversations(await json_body(request))
    rid = request.headers.get("x-request-id") or uuid.uuid4().hex
    ctxs = [await chat.prepare(state, sub, f"{rid}-{i}") for i, sub in enumerate(subs)]
    try:
        finals = await asyncio.gather(*(run_to_end(request, chat.launch(ctx, stream=False)) for ctx in ctxs))
    except ClientGone:
        return Response(status_code=499)
    answers = [chat._response(ctx, final) for ctx, (final,) in zip(ctxs, finals)]
    choices = []
    for i, answer in enumerate(answers):
        choices += [{**choice, "index": i} for choice in answer["choices"]]
    usage = {k: sum(a["usage"][k] for a in answers) for k in ("prompt_tokens", "completion_tokens", "total_tokens")}
    merged = {**answers[0], "id": f"chatcmpl-{rid}", "choices": choices, "usage": {**answers[0]["usage"], **usage}}
    if "prompt_token_ids" in merged:
        merged["prompt_token_ids"] = None  # one per conversation: each choice's own prompt is not in vLLM's shape
    return JSONResponse(merged, headers=rid_header(rid))
