"""`POST /v1/responses` (docs/protocols.md §2.9): converted to chat, run as chat, converted back.

Output items come in the order reasoning, message, function calls; with `return_token_ids` the
last item carries the turn's token fields, which clients send back unchanged next turn (§2.3 splice).
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.server.chat_parsing import ParsedMessage
from rlserve.server.limits import check_max_tokens
from rlserve.server.openai import chat, responses_store
from rlserve.server.openai.responses_input import to_chat_request
from rlserve.server.openai.responses_output import Turn, new_id, output_items
from rlserve.server.openai.responses_stream import stream_events
from rlserve.server.protocol import ResponsesRequest
from rlserve.server.state import ServerState, request_id, rid_header
from rlserve.server.streaming import ClientGone, SSEResponse, run_to_end, sse_stream, start_stream

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    check_max_tokens(state, body.max_output_tokens, "max_output_tokens")  # named as the client sent it
    ctx = await chat.prepare(state, to_chat_request(body), request_id(request, body))
    turn = Turn(ctx, body, new_id("resp"), int(time.time()))
    headers = rid_header(ctx.rid)
    if len(ctx.prompt) >= state.max_model_len:
        # §2.9 context-length rule: not an error, an empty incomplete turn the agent loop can stop on
        if body.stream:
            return SSEResponse(stream_events(turn, None), headers=headers)
        return JSONResponse(turn.finished(output_items(ParsedMessage(None)), None), headers=headers)
    run = chat.launch(ctx, stream=bool(body.stream))
    try:
        if body.stream:
            await start_stream(request, run)
            return SSEResponse(sse_stream(stream_events(turn, run), run), headers=headers)
        (final,) = await run_to_end(request, run)
    except ClientGone:
        return Response(status_code=499)
    o = final.outputs[0]
    parsed = ctx.parser.parse(o)
    items = output_items(parsed)
    items[-1].update(turn.token_fields(final))
    response = turn.finished(items, final)
    if parsed.tool_call_errors:  # malformed calls, kept as text (docs/parsers.md)
        response["tool_call_errors"] = [e.to_json() for e in parsed.tool_call_errors]
    return JSONResponse(responses_store.remember(request, body, response), headers=headers)
