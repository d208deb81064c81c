"""`POST /tokenize` and `/detokenize` (docs/protocols.md §2.5; also under `/v1/`).

The messages form renders exactly like chat completions, so clients can rebuild prompts byte for byte.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from rlserve.server.errors import bad_request
from rlserve.server.limits import check_text_fits
from rlserve.server.openai.chat_template import message_chars, render_chat
from rlserve.server.protocol import DetokenizeRequest, TokenizeRequest
from rlserve.server.state import ServerState

router = APIRouter()


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.rlserve
    state.check_model(body.model)
    if body.messages is not None:
        check_text_fits(state, message_chars(body), "messages")
        ids = await state.off_loop(
            render_chat, state.tokenizer, body, state.chat_template, state.config.server.trust_request_chat_template
        )
    elif body.prompt is not None:
        check_text_fits(state, len(body.prompt), "prompt")
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = await state.off_loop(lambda: state.tokenizer.encode(body.prompt, add_special_tokens=add))
    else:
        raise bad_request("send either prompt (a string) or messages", "prompt")
    strs = await state.off_loop(state.tokenizer.convert_ids_to_tokens, ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.rlserve
    state.check_model(body.model)
    state.check_token_ids(body.tokens, "tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}
