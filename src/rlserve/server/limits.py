"""Request caps at the HTTP boundary: body size (413), bodies that are not JSON a route could use (400),
and the engine's waiting queue (429 with Retry-After). Everything here runs before a route sees the body."""

from __future__ import annotations

import asyncio
import re

import msgspec
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlserve.server.errors import APIError

# bodies this large are checked in a worker thread, so the event loop keeps answering /health
_CHECK_INLINE_BYTES = 64 << 10
_LONE_SURROGATE = re.compile(rb"(?<!\\)(?:\\\\)*\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_SURROGATE_PAIR = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}")
RETRY_AFTER_S = 1
# multipart adapter uploads are bigger than any JSON request; that route caps and parses them itself
OWN_CAPS = frozenset({"/upload_adapter"})


class BodyGuard:
    """Refuses a body over `max_body_bytes` as soon as its size is known (Content-Length, or while it
    streams in), then checks that a JSON body is UTF-8, standard JSON (no NaN/Infinity), not absurdly
    nested and free of lone UTF-16 surrogates; tokenizers, headers and logs cannot carry those.
    Routes take JSON whatever the Content-Type says (curl -d sends a form type); OWN_CAPS are left alone."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app, self.max_body_bytes = app, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS") or scope["path"] in OWN_CAPS:
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        try:
            declared = int(headers.get(b"content-length", b"0"))
        except ValueError:
            declared = 0
        if declared > self.max_body_bytes:
            await self._refuse(scope, receive, send, _too_large(self.max_body_bytes))
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send, _too_large(self.max_body_bytes))
                return
        body = b"".join(chunks)
        content_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
        if body.strip():
            problem = await _check_json(body) if len(body) > _CHECK_INLINE_BYTES else _json_problem(body)
            if problem is not None:
                await APIError(400, problem).response()(scope, receive, send)
                return
            if content_type != b"application/json":
                scope = {
                    **scope,
                    "headers": [(k, v) for k, v in scope["headers"] if k != b"content-type"]
                    + [(b"content-type", b"application/json")],
                }
        await self.app(scope, _replay(body, receive), send)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, error: APIError) -> None:
        # the unread rest of the body cannot be skipped on a kept-alive connection: close it
        await error.response(headers={"Connection": "close"})(scope, receive, send)


def _too_large(cap: int) -> APIError:
    return APIError(
        413,
        f"request body is larger than {cap} bytes (server.max_body_bytes); send less, or raise the cap",
        param="server.max_body_bytes",
        type="RequestTooLargeError",
    )


async def _check_json(body: bytes) -> str | None:
    return await asyncio.to_thread(_json_problem, body)


def _json_problem(body: bytes) -> str | None:
    """What is wrong with a JSON body, or None. msgspec parses in C and rejects what JSON itself does."""
    try:
        msgspec.json.decode(body)
    except UnicodeDecodeError as exc:
        return _not_utf8(exc)
    except RecursionError:
        return "request body is not valid JSON: it is nested too deeply"
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        try:  # newer msgspec (0.23) reports bad UTF-8 as a DecodeError, without the byte: find it
            body.decode("utf-8")
        except UnicodeDecodeError as utf8:
            return _not_utf8(utf8)
        if _has_lone_surrogate(body):
            return (
                "request body is not valid JSON text: it holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
                "without its pair); send valid Unicode"
            )
        return f"request body is not valid JSON: {exc} (NaN, Infinity and numbers beyond float range are not JSON)"
    return None


def _not_utf8(exc: UnicodeDecodeError) -> str:
    return f"request body is not valid UTF-8 (byte {exc.start}); encode text as UTF-8"


def _has_lone_surrogate(body: bytes) -> bool:
    return bool(_LONE_SURROGATE.search(_SURROGATE_PAIR.sub(b"", body)))


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the disconnect, which routes watch for

    return replay


def _admit(engine, cap: int) -> None:
    """429 with Retry-After when the engine's waiting queue is full (server.max_waiting_requests)."""
    if cap and engine.stats.num_waiting >= cap:
        raise APIError(
            429,
            f"the server's waiting queue is full ({cap} requests, server.max_waiting_requests); "
            f"retry after {RETRY_AFTER_S} s",
            param="server.max_waiting_requests",
            type="RateLimitError",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


def check_text_fits(state, chars: int, field: str) -> None:
    """400 before tokenizing text that cannot fit: no token is longer than the vocabulary's longest (vLLM's
    wording; `field` is kept for callers, vLLM names the parameter input_text)."""
    if state._longest_token is None:
        state._longest_token = max(map(len, state.tokenizer.get_vocab()), default=1)
    bound = state.max_model_len * state._longest_token
    if chars > bound:
        raise _context_error(
            state,
            f"your prompt contains {chars} characters (more than {bound} characters, which is the upper bound "
            f"for {state.max_model_len} input tokens)",
            "input_text",
            chars,
        )


def check_prompt_fits(state, num_tokens: int) -> None:
    """vLLM's 400 for a prompt the context cannot hold, with room for at least one output token."""
    limit = state.max_model_len
    if num_tokens > limit:
        detail = (
            f"your prompt contains {num_tokens} input tokens, which exceeds this limit even without any output tokens"
        )
    elif num_tokens == limit:
        detail = f"your prompt contains {num_tokens} input tokens, which leaves no room for any output token"
    else:
        return
    raise _context_error(state, detail, "input_tokens", num_tokens)


def check_max_tokens(state, value: int | None, param: str) -> None:
    """vLLM's 400 for max_tokens (or max_completion_tokens) above the context length; below it, the
    engine caps it to what the prompt leaves, as vLLM does."""
    if value is not None and value > state.max_model_len:
        raise APIError(
            400,
            f"{param}={value} cannot be greater than max_model_len={state.max_model_len}. Please request fewer "
            f"output tokens. (parameter={param}, value={value})",
            param,
        )


def _context_error(state, detail: str, param: str, value: int) -> APIError:
    # NeMo Gym and others match on "This model's maximum context length is"
    return APIError(
        400,
        f"This model's maximum context length is {state.max_model_len} tokens. However, {detail}. Please reduce "
        f"the length of the input prompt. (parameter={param}, value={value})",
        param,
    )


def check_request_caps(state, params) -> None:
    """server.max_stop_strings / max_stop_string_chars, then the waiting-queue cap (429)."""
    server = state.config.server
    if len(params.stop) > server.max_stop_strings:
        raise APIError(
            400,
            f"stop holds {len(params.stop)} strings; at most {server.max_stop_strings} are allowed "
            "(server.max_stop_strings)",
            "stop",
        )
    if params.stop and max(map(len, params.stop)) > server.max_stop_string_chars:
        raise APIError(
            400,
            f"a stop string is longer than {server.max_stop_string_chars} characters (server.max_stop_string_chars)",
            "stop",
        )
    _admit(state.engine, server.max_waiting_requests)
