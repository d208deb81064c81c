"""`POST /v1/completions` (docs/protocols.md §2.2): text or token-id prompts, n, echo, logprobs, SSE."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.server.errors import bad_request
from rlserve.server.limits import check_max_tokens, check_prompt_fits, check_text_fits
from rlserve.server.openai.vllm_shape import RESPONSE, SYSTEM_FINGERPRINT, stream_metrics, stream_usage
from rlserve.server.protocol import POLICY_FIELDS, CompletionRequest
from rlserve.server.sampling import full_vocabulary, sampling_params, truncate
from rlserve.server.staleness import hold_for_policy_version
from rlserve.server.state import (
    ChoiceCursor,
    ServerState,
    cached_tokens,
    clamp,
    prompt_logprobs_json,
    request_id,
    rid_header,
    usage,
    usage_switches,
    version_fields,
)
from rlserve.server.streaming import ClientGone, Run, SSEResponse, run_to_end, sse, sse_stream, start_stream
from rlserve.server.structured_request import logprobs_header

router = APIRouter()


@dataclass
class Ctx:
    """Everything the response builders need besides the engine outputs."""

    state: ServerState
    body: CompletionRequest
    id: str
    model: str
    created: int
    k: int | None  # completion logprobs
    prompt_texts: list[str | None]
    score_only: bool  # echo with max_tokens 0: the one sampled token is dropped


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    model = state.check_model(body.model)
    check_max_tokens(state, body.max_tokens, "max_tokens")
    await hold_for_policy_version(state, body.model_dump(include=POLICY_FIELDS))
    prompts, texts = await state.off_loop(_prompts, state, body)
    k = full_vocabulary(state, _logprobs_k(body.logprobs), "logprobs")
    score_only = body.echo and body.max_tokens == 0
    prompt_k = _prompt_k(body, k)
    params = sampling_params(
        state,
        body,
        max_tokens=1 if score_only else body.max_tokens,
        logprobs=k,
        prompt_logprobs=prompt_k,
    )
    rid = request_id(request, body)
    ctx = Ctx(state, body, f"cmpl-{rid}", model, int(time.time()), k, texts, score_only)
    run = Run(state, prompts, params, rid, body.cache_salt, adapter=state.adapter_for(body.model), stream=body.stream)
    headers = rid_header(rid) | logprobs_header(params, state.config.engine.logprobs_mode)
    try:
        if body.stream:
            await start_stream(request, run)
            return SSEResponse(sse_stream(_stream(ctx, run), run), headers=headers)
        finals = await run_to_end(request, run)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, finals) | {"metrics": run.request_metrics()}, headers=headers)


def _prompt_k(body: CompletionRequest, k: int | None) -> int | None:
    """Echoed logprobs come from the prompt logprobs (and are returned as them too, as vLLM does)."""
    if body.echo and k is not None:
        return -1 if -1 in (k, body.prompt_logprobs) else max(k, body.prompt_logprobs or 0)
    return body.prompt_logprobs


def _logprobs_k(value: bool | int | None) -> int | None:
    if value is None or value is False:
        return None
    return 1 if value is True else value


def _prompts(state: ServerState, body: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
    """Token ids of every prompt, and its text when the client sent text (for echo)."""
    p = body.prompt
    if (body.model_extra or {}).get("prompt_embeds"):
        raise bad_request(
            "prompt_embeds is not supported (rlserve has no --enable-prompt-embeds): send the prompt as text or "
            "token ids",
            "prompt_embeds",
        )
    if p is None or p == "" or p == []:
        raise bad_request(  # vLLM's words first: clients match on them
            "Either prompt or prompt_embeds must be provided and non-empty. rlserve takes prompt only: a string, "
            "a list of strings or token ids",
            "prompt",
        )
    if isinstance(p, str):
        items: list = [p]
    elif isinstance(p, list) and p and all(_is_id(t) for t in p):
        items = [p]
    elif (
        isinstance(p, list)
        and p
        and all(isinstance(x, str) or (isinstance(x, list) and all(map(_is_id, x))) for x in p)
    ):
        items = p
    else:
        raise bad_request(
            "prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt"
        )
    ids, texts = [], []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt is empty: send at least one character or token id", "prompt")
            if body.truncate_prompt_tokens is None:
                check_text_fits(state, len(item), "prompt")
            tokens = state.tokenizer.encode(item, add_special_tokens=body.add_special_tokens)
        else:
            if not item:
                raise bad_request("prompt is empty: a token-id list needs at least one id", "prompt")
            tokens = item
        kept = truncate(tokens, body.truncate_prompt_tokens, state.max_model_len, body.truncation_side)
        check_prompt_fits(state, len(kept))
        ids.append(kept)
        texts.append(item if isinstance(item, str) and len(kept) == len(tokens) else None)
    return ids, texts


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _visible(ctx: Ctx, o: CompletionOutput) -> CompletionOutput:
    if not ctx.score_only:
        return o
    return CompletionOutput(
        o.index,
        [],
        "",
        [] if o.logprobs is not None else None,
        [] if o.top_logprobs is not None else None,
        finish_reason="length" if o.finished else None,
    )


def _prompt_text(ctx: Ctx, i: int, out: RequestOutput) -> str:
    text = ctx.prompt_texts[i]
    if text is None:
        text = ctx.state.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=ctx.body.skip_special_tokens)
    return text


def _logprobs(
    ctx: Ctx, token_ids: list[int], lps: list[float], tops: list[dict[int, float]] | None, offset: int
) -> dict[str, list]:
    """Completions logprobs of generated tokens; top_logprobs = the k best plus the sampled token."""
    state, as_ids = ctx.state, ctx.body.return_tokens_as_token_ids
    tokens, offsets, top_logprobs = [], [], []
    for j, (t, lp) in enumerate(zip(token_ids, lps)):
        tokens.append(state.token_label(t, as_ids))
        offsets.append(offset)
        offset += len(state.token_label(t, as_ids))  # vLLM counts the label, token_id:N included
        top = {state.token_label(tid, as_ids): clamp(v) for tid, v in (tops[j] if tops else {}).items()}
        top.setdefault(state.token_label(t, as_ids), clamp(lp))
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": [clamp(x) for x in lps],
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def _echo_logprobs(ctx: Ctx, out: RequestOutput) -> dict[str, list]:
    """The prompt part of echoed logprobs: the first token has none."""
    state, as_ids, ids = ctx.state, ctx.body.return_tokens_as_token_ids, out.prompt_token_ids
    entries = prompt_logprobs_json(state, out, ctx.k, as_ids) or [None] * len(ids)
    result: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = 0
    for t, entry in zip(ids, entries):
        result["tokens"].append(state.token_label(t, as_ids))
        result["text_offset"].append(offset)
        offset += len(state.token_label(t, as_ids))  # vLLM counts the label, token_id:N included
        if entry is None:
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            result["token_logprobs"].append(entry[str(t)]["logprob"])
            result["top_logprobs"].append(
                {state.token_label(int(tid), as_ids): e["logprob"] for tid, e in entry.items()}
            )
    return result


def _concat(a: dict[str, list], b: dict[str, list]) -> dict[str, list]:
    return {key: a[key] + b[key] for key in a}


def _choice(ctx: Ctx, i: int, out: RequestOutput, o: CompletionOutput, cur: ChoiceCursor) -> dict[str, Any] | None:
    """The part of choice `o` not yet sent (all of it for a fresh cursor); None when nothing is new."""
    body = ctx.body
    first, finishing = not cur.started, o.finished and not cur.finished
    new_ids, new_text = o.token_ids[cur.tokens :], o.text[cur.text :]
    if not (first or finishing or new_ids or new_text):
        return None
    prefix = _prompt_text(ctx, i, out) if first and body.echo else ""
    logprobs = None
    if ctx.k is not None:
        if first and body.echo:
            cur.offset = len(prefix)
        logprobs = _logprobs(
            ctx, new_ids, o.logprobs[cur.tokens :], o.top_logprobs and o.top_logprobs[cur.tokens :], cur.offset
        )
        if first and body.echo:
            logprobs = _concat(_echo_logprobs(ctx, out), logprobs)
        cur.offset += sum(len(ctx.state.token_label(t, body.return_tokens_as_token_ids)) for t in new_ids)
    choice: dict[str, Any] = {
        "index": i * body.n + o.index,
        "text": prefix + new_text,
        "logprobs": logprobs,
        "finish_reason": o.finish_reason if finishing else None,
        "stop_reason": o.stop_reason if finishing else None,
    }
    # vLLM's keys, null without return_token_ids; the prompt's ids ride in the first chunk only
    # (streamed with echo too, as vLLM does)
    wants_prompt_ids = body.return_token_ids or (body.echo and body.stream)
    choice["prompt_token_ids"] = out.prompt_token_ids if wants_prompt_ids and first else None
    choice["token_ids"] = new_ids if body.return_token_ids else None
    if finishing:
        choice.update(version_fields(ctx.state, o))
    cur.tokens, cur.text, cur.started, cur.finished = len(o.token_ids), len(o.text), True, o.finished
    return choice


def _response(ctx: Ctx, finals: list[RequestOutput]) -> dict[str, Any]:
    choices, completion_tokens = [], 0
    for i, out in enumerate(finals):
        prompt_logprobs = prompt_logprobs_json(
            ctx.state, out, _prompt_k(ctx.body, ctx.k), ctx.body.return_tokens_as_token_ids
        )
        for o in sorted(out.outputs, key=lambda o: o.index):
            o = _visible(ctx, o)
            choice = _choice(ctx, i, out, o, ChoiceCursor())
            choice["prompt_logprobs"] = prompt_logprobs
            choice["routed_experts"] = None
            choices.append(choice)
            completion_tokens += len(o.token_ids)
    prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
    cached = sum(out.num_cached_tokens for out in finals)
    return {
        "id": ctx.id,
        "object": "text_completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": choices,
        **RESPONSE,
        "usage": usage(prompt_tokens, completion_tokens, cached_tokens(ctx.state, cached)),
        "kv_transfer_params": finals[0].kv_transfer_params if finals else None,
    }


async def _stream(ctx: Ctx, run: Run) -> AsyncIterator[str]:
    head = {"id": ctx.id, "object": "text_completion", "created": ctx.created, "model": ctx.model}
    include_usage, continuous = usage_switches(ctx.state, ctx.body.stream_options)
    cursors: dict[tuple[int, int], ChoiceCursor] = {}
    latest: dict[int, RequestOutput] = {}
    async for i, out in run.events():
        latest[i] = out
        for o in out.outputs:
            choice = _choice(ctx, i, out, _visible(ctx, o), cursors.setdefault((i, o.index), ChoiceCursor()))
            if choice is not None:
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = stream_usage(_usage(ctx, latest), details=False)
                if choice["finish_reason"] is not None and not include_usage:
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT  # the last chunk carries it
                yield sse(chunk)
    if include_usage:
        usage_chunk = {**head, "choices": [], "usage": stream_usage(_usage(ctx, latest), details=False)}
        yield sse({**usage_chunk, "system_fingerprint": SYSTEM_FINGERPRINT, **stream_metrics(run)})


def _usage(ctx: Ctx, latest: dict[int, RequestOutput]) -> dict[str, Any]:
    outs = latest.values()
    completion = sum(len(_visible(ctx, o).token_ids) for out in outs for o in out.outputs)
    cached = cached_tokens(ctx.state, sum(out.num_cached_tokens for out in outs))
    return usage(sum(len(out.prompt_token_ids) for out in outs), completion, cached)
