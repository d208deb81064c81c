"""`POST /tokenize` and `/detokenize` (docs/protocols.md §2.5; also under `/v1/`).

The messages form renders exactly like chat completions, so clients can rebuild prompts byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

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


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    """vLLM's --enable-tokenizer-info-endpoint answer: the tokenizer's init kwargs (file paths dropped, added
    tokens as their text), its class name, and the server's --chat-template when one was given."""
    state: ServerState = request.app.state.rlserve
    info = {k: v for k, v in (getattr(state.tokenizer, "init_kwargs", None) or {}).items()}
    info.pop("vocab_file", None)
    info.pop("merges_file", None)
    info = _plain(info)
    info["tokenizer_class"] = type(state.tokenizer).__name__
    if state.chat_template:
        info["chat_template"] = state.chat_template
    return JSONResponse(json.loads(json.dumps(info, default=str)))


def _plain(obj: Any) -> Any:
    if hasattr(obj, "content"):  # an AddedToken
        return obj.content
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    return obj


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.rlserve
    state.check_model(body.model)
    state.check_token_ids(body.tokens, "tokens")
    return {"prompt": await state.off_loop(state.tokenizer.decode, body.tokens)}
