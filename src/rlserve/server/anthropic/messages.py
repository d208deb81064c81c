"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic Messages, converted to a chat request,
run on the chat path, answered in Anthropic's shapes (vLLM 0.32 parity). Errors use Anthropic's
`{"type": "error", "error": {...}}` shape with the same 4xx statuses as chat."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.engine.outputs import RequestOutput
from rlserve.runtime.face import EngineDeadError
from rlserve.server.anthropic.convert import (
    CountTokensRequest,
    MessagesRequest,
    error_body,
    stop_reason,
    to_chat_request,
    usage,
)
from rlserve.server.anthropic.stream import MessageEvents
from rlserve.server.errors import APIError, bad_request
from rlserve.server.openai import chat
from rlserve.server.openai.chat_template import render_chat
from rlserve.server.state import ServerState, json_body, request_id, rid_header
from rlserve.server.streaming import ClientGone, Run, SSEResponse, run_to_end, start_stream

router = APIRouter()


@router.post("/v1/messages")
async def create_message(request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    try:
        body = _parse(await json_body(request), MessagesRequest)
        chat_body = to_chat_request(body)
        ctx = await chat.prepare(state, chat_body, request_id(request, chat_body))
        run = chat.launch(ctx, stream=bool(body.stream))
        headers = rid_header(ctx.rid)
        if body.stream:
            await start_stream(request, run)
            return SSEResponse(_events(ctx, run), headers=headers)
        (final,) = await run_to_end(request, run)
    except ClientGone:
        return Response(status_code=499)
    except APIError as err:
        return _error(err)
    except pydantic.ValidationError as exc:  # the converted chat request's own checks
        return _error(invalid(exc))
    except EngineDeadError as exc:
        return _error(APIError(503, str(exc)))
    return JSONResponse(_message(ctx, final), headers=headers)


@router.post("/v1/messages/count_tokens")
async def count_tokens(request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    try:
        chat_body = to_chat_request(_parse(await json_body(request), CountTokensRequest))
        state.check_model(chat_body.model)
        prompt = await state.off_loop(
            render_chat,
            state.tokenizer,
            chat_body,
            state.chat_template,
            state.config.server.trust_request_chat_template,
        )
    except APIError as err:
        return _error(err)
    except pydantic.ValidationError as exc:
        return _error(invalid(exc))
    n = len(prompt)
    return JSONResponse({"input_tokens": n, "context_management": {"original_input_tokens": n}})


def _parse(raw: dict[str, Any], model: type[MessagesRequest]) -> MessagesRequest:
    try:
        return model.model_validate(raw)
    except pydantic.ValidationError as exc:
        raise invalid(exc) from None


def invalid(exc: pydantic.ValidationError) -> APIError:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ()))
    message = str(err.get("msg")).removeprefix("Value error, ")
    return bad_request(f"{where}: {message}" if where else message, where or None)


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err), status_code=err.status, headers=err.headers)


def _message(ctx: chat.Ctx, out: RequestOutput) -> dict[str, Any]:
    o = out.outputs[0]
    parsed = ctx.parser.parse(o)
    content: list[dict[str, Any]] = []
    if parsed.reasoning:
        content.append({"type": "thinking", "thinking": parsed.reasoning, "signature": uuid.uuid4().hex})
    if parsed.content:
        content.append({"type": "text", "text": parsed.content})
    for call in parsed.tool_calls:
        fn = call["function"]
        content.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": json.loads(fn["arguments"])})
    reason, sequence = stop_reason(o.finish_reason, o.stop_reason, bool(parsed.tool_calls))
    answer: dict[str, Any] = {
        "id": ctx.id,
        "type": "message",
        "role": "assistant",
        "content": content or [{"type": "text", "text": ""}],  # strict clients read content[0]
        "model": ctx.model,
        "stop_reason": reason,
    }
    if sequence is not None:
        answer["stop_sequence"] = sequence
    answer["usage"] = usage(len(out.prompt_token_ids), len(o.token_ids))
    if out.kv_transfer_params is not None:
        answer["kv_transfer_params"] = out.kv_transfer_params
    return answer


async def _events(ctx: chat.Ctx, run: Run) -> AsyncIterator[str]:
    events = MessageEvents(ctx.id, ctx.model)
    streamer = ctx.parser.streamer()
    last: RequestOutput | None = None
    try:
        async for _, out in run.events():
            if last is None:
                yield events.start(len(out.prompt_token_ids))
            last = out
            for event in events.apply(streamer.feed(out.outputs[0])):
                yield event
        o = last.outputs[0]
        reason, sequence = stop_reason(o.finish_reason, o.stop_reason, events.tool_used)
        for event in events.finish(reason, sequence, usage(len(last.prompt_token_ids), len(o.token_ids))):
            yield event
    except Exception as exc:  # the 200 is gone: tell the client in-band
        err = exc if isinstance(exc, APIError) else APIError(500, f"internal server error: {exc!r}")
        yield events.event("error", error=error_body(err)["error"])
    finally:
        await run.close()
