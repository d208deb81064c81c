"""`POST /tokenize` and `/detokenize` (wire-protocols §2.5; also under `/v1/`).

The messages form renders exactly like chat completions, so clients can rebuild prompts byte for byte.
"""

from __future__ import annotations

from fastapi import APIRouter, Request

from rlserve.server.chat_template import render_chat
from rlserve.server.errors import bad_request
from rlserve.server.protocol import DetokenizeRequest, TokenizeRequest
from rlserve.server.serving import ServerState

router = APIRouter()


@router.post("/tokenize")
@router.post("/v1/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.rlserve
    state.check_model(body.model)
    if body.messages is not None:
        ids = render_chat(state.tokenizer, body, state.chat_template)
    elif body.prompt is not None:
        add = True if body.add_special_tokens is None else body.add_special_tokens
        ids = state.tokenizer.encode(body.prompt, add_special_tokens=add)
    else:
        raise bad_request("send either prompt (a string) or messages", "prompt")
    strs = state.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
@router.post("/v1/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    state: ServerState = request.app.state.rlserve
    state.check_model(body.model)
    state.check_token_ids(body.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(body.tokens)}
