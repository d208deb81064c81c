"""`POST /v1/chat/completions` (docs/protocols.md §2.3): chat template in, message + token ids out."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.server.chat_parsing import (
    MessageStreamer,
    OutputParser,
    ParsedMessage,
    output_parser,
)
from rlserve.server.errors import bad_request
from rlserve.server.limits import check_max_tokens, check_prompt_fits, check_text_fits
from rlserve.server.openai.chat_echo import echo_prompt_logprobs, echoed
from rlserve.server.openai.chat_template import message_chars, render_chat
from rlserve.server.openai.vllm_shape import (
    CHAT_CHOICE,
    CHAT_MESSAGE,
    CHAT_RESPONSE,
    SYSTEM_FINGERPRINT,
    stream_metrics,
    stream_usage,
)
from rlserve.server.protocol import POLICY_FIELDS, ChatCompletionRequest, ChatTokensRequest
from rlserve.server.reasoning_grammar import constrain_after_reasoning
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
    sampled_first,
    usage,
    usage_switches,
    version_fields,
)
from rlserve.server.streaming import ClientGone, Run, SSEResponse, run_to_end, sse, sse_stream, start_stream
from rlserve.server.structured_request import (
    check_auto_tool_choice,
    enforce_tool_choice,
    grammar_checker,
    logprobs_header,
)

router = APIRouter()
log = logging.getLogger(__name__)


@dataclass
class Ctx:
    """One chat request, rendered and checked, ready to run (shared with /v1/responses)."""

    state: ServerState
    body: ChatCompletionRequest
    id: str
    model: str
    created: int
    rid: str
    prompt: list[int]
    params: SamplingParams
    parser: OutputParser


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state: ServerState = request.app.state.rlserve
    check_auto_tool_choice(state.config.model.tool_call_parser, body)
    prompt = _forwarded_prompt(state, body)
    return await _respond(request, await prepare(state, body, request_id(request, body), prompt=prompt))


def _forwarded_prompt(state: ServerState, body: ChatCompletionRequest) -> list[int] | None:
    """vLLM's P/D token reuse: `kv_transfer_params.prompt_token_ids` (the prefill's prompt) is the prompt, verbatim."""
    ids = (body.kv_transfer_params or {}).get("prompt_token_ids")
    if ids is None:
        return None
    field = "kv_transfer_params.prompt_token_ids"
    if not (isinstance(ids, list) and ids and all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):
        raise bad_request(f"{field} must be a non-empty list of token ids", field)
    state.check_token_ids(ids, field)
    return ids


@router.post("/v1/chat/completions/tokens")
async def create_chat_completion_from_tokens(body: ChatTokensRequest, request: Request) -> Response:
    """verifiers' TITO client (§2.7): messages still render (parsers need their context), but the
    prompt is `tokens`, verbatim."""
    state: ServerState = request.app.state.rlserve
    tokens = body.tokens
    if not tokens or not all(isinstance(t, int) for t in tokens):
        raise bad_request("tokens must be a non-empty list of token ids", "tokens")
    state.check_token_ids(tokens, "tokens")
    if len(tokens) >= state.max_model_len:
        raise bad_request(
            f"tokens has {len(tokens)} tokens; this model's maximum context length is {state.max_model_len} tokens",
            "tokens",
        )
    return await _respond(request, await prepare(state, body, request_id(request, body), prompt=tokens))


async def _respond(request: Request, ctx: Ctx) -> Response:
    body = ctx.body
    check_prompt_fits(ctx.state, len(ctx.prompt))  # here, not in prepare: /v1/responses answers it differently
    run = launch(ctx)
    headers = rid_header(ctx.rid) | logprobs_header(ctx.params, ctx.state.config.engine.logprobs_mode)
    try:
        if body.stream:
            await start_stream(request, run)
            return SSEResponse(sse_stream(_stream(ctx, run), run), headers=headers)
        (final,) = await run_to_end(request, run)
    except ClientGone:
        return Response(status_code=499)
    return JSONResponse(_response(ctx, final) | {"metrics": run.request_metrics()}, headers=headers)


async def prepare(state: ServerState, body: ChatCompletionRequest, rid: str, prompt: list[int] | None = None) -> Ctx:
    model = state.check_model(body.model)
    if body.max_completion_tokens is not None:
        check_max_tokens(state, body.max_completion_tokens, "max_completion_tokens")
    else:
        check_max_tokens(state, body.max_tokens, "max_tokens")
    await hold_for_policy_version(state, body.model_dump(include=POLICY_FIELDS))
    if body.truncate_prompt_tokens is None and prompt is None:
        check_text_fits(state, message_chars(body), "messages")
    shown = body  # what the template sees: vLLM's --exclude-tools-when-tool-choice-none hides the tools
    if state.config.server.exclude_tools_when_tool_choice_none and body.tool_choice == "none":
        shown = body.model_copy(update={"tools": None})
    rendered = await state.off_loop(
        render_chat, state.tokenizer, shown, state.chat_template, state.config.server.trust_request_chat_template
    )
    if prompt is None:
        prompt = truncate(rendered, body.truncate_prompt_tokens, state.max_model_len, body.truncation_side)
    elif prompt[: len(rendered)] != rendered:
        log.info("request %s: tokens differ from the rendered messages; using tokens as sent", rid)
    max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    top = _top_logprobs(state, body)
    params = sampling_params(
        state, body, max_tokens=max_tokens, logprobs=top, prompt_logprobs=echo_prompt_logprobs(body, top)
    )
    parser = output_parser(state.config.model, state.tokenizer, body, params, prompt)
    enforce_tool_choice(state.config.model.tool_call_parser, state.engine, body, params)
    enable_thinking = (body.chat_template_kwargs or {}).get("enable_thinking")
    constrain_after_reasoning(
        grammar_checker(state.engine),
        state.tokenizer,
        params,
        state.config.model.reasoning_parser,
        enable_thinking,
        prompt,
    )
    return Ctx(state, body, f"chatcmpl-{rid}", model, int(time.time()), rid, prompt, params, parser)


def launch(ctx: Ctx, stream: bool | None = None) -> Run:
    stream = bool(ctx.body.stream) if stream is None else stream
    return Run(
        ctx.state,
        [ctx.prompt],
        ctx.params,
        ctx.rid,
        ctx.body.cache_salt,
        adapter=ctx.state.adapter_for(ctx.body.model),
        stream=stream,
    )


def _top_logprobs(state: ServerState, body: ChatCompletionRequest) -> int | None:
    if not body.logprobs:
        if body.top_logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    k = full_vocabulary(state, body.top_logprobs, "top_logprobs") or 0
    cap = state.config.engine.max_logprobs
    if k < 0 or (cap != -1 and k > cap):
        limit = "an integer >= 0" if cap == -1 else f"between 0 and {cap} (engine.max_logprobs)"
        raise bad_request(f"top_logprobs must be {limit}, got {k}", "top_logprobs")
    return k


def _logprob_entry(state: ServerState, token_id: int, logprob: float, as_ids: bool) -> dict[str, Any]:
    return {
        "token": state.token_label(token_id, as_ids),
        "logprob": clamp(logprob),
        "bytes": list(state.token_text(token_id).encode("utf-8")),
    }


def _logprobs(ctx: Ctx, o: CompletionOutput, start: int) -> dict[str, list] | None:
    if o.logprobs is None:
        return None
    state, as_ids = ctx.state, ctx.body.return_tokens_as_token_ids
    content = []
    for j in range(start, len(o.token_ids)):
        entry = _logprob_entry(state, o.token_ids[j], o.logprobs[j], as_ids)
        top = o.top_logprobs[j] if o.top_logprobs else {}
        pairs = sampled_first(o.token_ids[j], o.logprobs[j], top)
        entry["top_logprobs"] = [_logprob_entry(state, t, lp, as_ids) for t, lp in pairs]
        content.append(entry)
    return {"content": content}


def finish_reason(o: CompletionOutput, has_tool_calls: bool, tool_choice: Any = None) -> str | None:
    """vLLM's and OpenAI's: calls the model chose finish "tool_calls" (over "length" too; len(token_ids)
    reveals truncation); a `required` call "tool_calls" unless cut short; a call forced by name finishes as
    the engine finished ("stop")."""
    if not has_tool_calls or o.finish_reason == "abort" or isinstance(tool_choice, dict):
        return o.finish_reason
    if tool_choice == "required" and o.finish_reason != "stop":
        return o.finish_reason
    return "tool_calls"


def message_json(parsed: ParsedMessage) -> dict[str, Any]:
    message = {
        "role": "assistant",
        "content": parsed.content,
        **CHAT_MESSAGE,
        "reasoning": parsed.reasoning,
        "reasoning_content": parsed.reasoning,
    }
    if parsed.tool_calls:  # vLLM leaves out an empty list
        message["tool_calls"] = parsed.tool_calls
    return message


def _response(ctx: Ctx, out: RequestOutput) -> dict[str, Any]:
    body, choices = ctx.body, []
    for o in sorted(out.outputs, key=lambda o: o.index):
        parsed = ctx.parser.parse(o)
        if body.echo:
            parsed.content = echoed(body) + (parsed.content or "")
        if body.tool_choice == "required" or isinstance(body.tool_choice, dict):
            parsed.content = parsed.content or ""  # vLLM's: an enforced call comes with "" beside it, not null
        choice = {
            "index": o.index,
            "message": message_json(parsed),
            "logprobs": _logprobs(ctx, o, 0),
            "finish_reason": finish_reason(o, bool(parsed.tool_calls), body.tool_choice),
            "stop_reason": o.stop_reason,
            **CHAT_CHOICE,
        }
        if parsed.tool_call_errors:
            choice["tool_call_errors"] = [e.to_json() for e in parsed.tool_call_errors]
        if body.return_token_ids:
            choice["token_ids"] = o.token_ids
        choice.update(version_fields(ctx.state, o))
        choices.append(choice)
    response = {"id": ctx.id, "object": "chat.completion", "created": ctx.created, "model": ctx.model}
    return {
        **response,
        "choices": choices,
        **CHAT_RESPONSE,
        "prompt_token_ids": out.prompt_token_ids if body.return_token_ids else None,
        "usage": _usage(ctx, out),
        "prompt_logprobs": prompt_logprobs_json(
            ctx.state, out, ctx.params.prompt_logprobs, body.return_tokens_as_token_ids
        ),
        "kv_transfer_params": out.kv_transfer_params,
    }


def _delta_choice(ctx: Ctx, o: CompletionOutput, cur: ChoiceCursor, streamer: MessageStreamer) -> dict[str, Any] | None:
    """Every new token rides in exactly one chunk, even when the parser holds its text back."""
    finishing = o.finished and not cur.finished
    new_ids = o.token_ids[cur.tokens :]
    delta = streamer.feed(o)
    if not (finishing or new_ids or delta):
        return None
    choice: dict[str, Any] = {
        "index": o.index,
        "delta": delta,
        "logprobs": _logprobs(ctx, o, cur.tokens),
        "finish_reason": finish_reason(o, streamer.has_tool_calls, ctx.body.tool_choice) if finishing else None,
    }
    choice["token_ids"] = new_ids if ctx.body.return_token_ids else None
    if finishing:
        choice["stop_reason"] = o.stop_reason
        if streamer.tool_call_errors:
            choice["tool_call_errors"] = [e.to_json() for e in streamer.tool_call_errors]
        choice.update(version_fields(ctx.state, o))
    cur.tokens, cur.finished = len(o.token_ids), o.finished
    return choice


async def _stream(ctx: Ctx, run: Run) -> AsyncIterator[str]:
    body = ctx.body
    head = {"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model}
    options = body.stream_options
    cursors = [ChoiceCursor() for _ in range(body.n)]
    streamers = [ctx.parser.streamer() for _ in range(body.n)]
    latest: RequestOutput | None = None
    include_usage, continuous = usage_switches(ctx.state, options)
    async for _, out in run.events():
        if latest is None:
            for i in range(body.n):  # the role goes first and alone, one chunk per choice
                role = {
                    "index": i,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
                chunk = {
                    **head,
                    "choices": [role],
                    "prompt_token_ids": out.prompt_token_ids if body.return_token_ids else None,
                    "prompt_text": None,
                }
                if continuous:
                    chunk["usage"] = stream_usage(_usage(ctx, out, role_chunk=True), details=True)
                yield sse(chunk)
            if body.echo and echoed(body):
                for i in range(body.n):
                    choice = {"index": i, "delta": {"content": echoed(body)}, "logprobs": None, "finish_reason": None}
                    yield sse({**head, "choices": [choice]})
        latest = out
        for o in out.outputs:
            choice = _delta_choice(ctx, o, cursors[o.index], streamers[o.index])
            if choice is not None:
                chunk = {**head, "choices": [choice]}
                if continuous:
                    chunk["usage"] = stream_usage(_usage(ctx, out), details=True)
                if choice["finish_reason"] is not None and not include_usage:
                    chunk["system_fingerprint"] = SYSTEM_FINGERPRINT  # the last chunk carries it
                yield sse(chunk)
    if include_usage and latest is not None:
        usage_chunk = {**head, "choices": [], "usage": stream_usage(_usage(ctx, latest), details=False)}
        yield sse({**usage_chunk, "system_fingerprint": SYSTEM_FINGERPRINT, **stream_metrics(run)})


def _usage(ctx: Ctx, out: RequestOutput, role_chunk: bool = False) -> dict[str, Any]:
    """Usage so far; the role chunk's (continuous usage) counts no completion tokens yet, as vLLM's."""
    completion_tokens = 0 if role_chunk else sum(len(o.token_ids) for o in out.outputs)
    result = usage(len(out.prompt_token_ids), completion_tokens, cached_tokens(ctx.state, out.num_cached_tokens))
    if ctx.parser.reasoning_parser is not None:
        reasoning = 0 if role_chunk else sum(ctx.parser.reasoning_tokens(o.token_ids) for o in out.outputs)
        result["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return result
