"""What the OpenAI-style routes share: server state, sampling params, running engine requests
concurrently while watching for a vanished client, and the rlserve fields every choice carries."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.responses import StreamingResponse

from rlserve.config import Config
from rlserve.engine.async_engine import AsyncEngine, EngineDeadError
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.server.errors import APIError, bad_request, from_value_error
from rlserve.server.limits import check_request_caps
from rlserve.server.metrics import Metrics, weight_version
from rlserve.server.protocol import Body, GenerationFields
from rlserve.server.structured_request import allowed_token_ids, checked, constraint

T = TypeVar("T")
log = logging.getLogger(__name__)
NEG_INF_JSON = -9999.0  # vLLM's clamp: JSON has no -inf
LOGIT_BIAS_LIMIT = 100.0
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "top_logprobs", "max_completion_tokens"}


@dataclass
class ServerState:
    engine: AsyncEngine
    config: Config
    metrics: Metrics
    served_model_name: str
    chat_template: str | None = None  # config.model.chat_template, loaded
    default_adapter: str | None = None  # MLX-style /load_adapter: the adapter behind the base model
    last_update: tuple | None = None  # (directory fingerprint, policy version) of the last disk update
    draining: bool = False  # SIGTERM received: new requests get 503
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)
    # tokenizing and template rendering run here, never on the event loop; one thread, as the
    # Rust tokenizer is not safe for concurrent use ("Already borrowed")
    _tokenizer_thread: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rlserve-tokenize"))
    _longest_token: int | None = None

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._tokenizer_thread, functools.partial(fn, *args))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def check_model(self, model: str | None) -> str:
        """The name to echo in the response; 404 for a model this server does not serve."""
        if model is None or model in (self.served_model_name, self.config.model.name):
            return model or self.served_model_name
        if model in self.engine.adapters:
            return model
        raise APIError(404, f"the model `{model}` does not exist; this server serves `{self.served_model_name}`",
                       param="model", type="NotFoundError")

    def check_adapter(self, name: str, param: str) -> str:
        """A loaded adapter by name (or the path it was loaded from); 404 otherwise, never the base model."""
        adapters = self.engine.adapters  # name -> path
        if name in adapters:
            return name
        for known, path in adapters.items():
            if path == name:
                return known
        raise APIError(404, f"LoRA adapter `{name}` is not loaded; load it first or drop {param}", param=param,
                       type="NotFoundError")

    def adapter_for(self, model: str | None) -> str | None:
        """A request picks a LoRA adapter by naming it as its model; the base model name means none
        (or the MLX-style default adapter, once one is loaded)."""
        if model is not None and model in self.engine.adapters:
            return model
        return self.default_adapter

    def check_policy_version(self, fields: dict[str, Any]) -> None:
        """rlserve extension: 409 when the served policy is outside the caller's window
        (min_policy_version / max_policy_version, or policy_version + max_staleness)."""
        current = self.engine.policy_version
        low, high = fields.get("min_policy_version"), fields.get("max_policy_version")
        if fields.get("max_staleness") is not None and fields.get("policy_version") is not None:
            base = int(fields["policy_version"])
            low = base if low is None else max(low, base)
            high = base + int(fields["max_staleness"]) if high is None else min(high, base + int(fields["max_staleness"]))
        if low is not None and current < low:
            raise APIError(409, f"server policy_version {current} is older than min_policy_version {low}",
                           param="min_policy_version", type="ConflictError")
        if high is not None and current > high:
            raise APIError(409, f"server policy_version {current} is newer than allowed ({high})",
                           param="max_policy_version", type="ConflictError")

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

    def token_label(self, token_id: int, as_ids: bool) -> str:
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def check_token_ids(self, ids: list[int], what: str) -> None:
        vocab = self.engine.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} in {what} is outside the vocabulary [0, {vocab})", what)


async def json_body(request: Request, model: type[Body] | None = None) -> dict[str, Any]:
    """The body of a route that parses its own JSON (control and native routes): empty = {}.
    With `model`: validated by it (400 naming the field) and returned as the fields the client sent."""
    raw = await request.body()
    body = {}
    if raw.strip():
        try:
            body = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
    return body if model is None else validated(body, model)


def validated(body: dict[str, Any], model: type[Body]) -> dict[str, Any]:
    try:
        return model.model_validate(body).model_dump(exclude_unset=True)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


def request_id(request: Request, body: Any) -> str:
    return request.headers.get("x-request-id") or getattr(body, "request_id", None) or getattr(
        body, "rid", None) or uuid.uuid4().hex


def rid_header(rid: str) -> dict[str, str]:
    """The id echoed in X-Request-Id; headers carry printable ASCII only, so anything else is %-encoded."""
    safe = rid.isascii() and rid.isprintable()
    return {"X-Request-Id": rid if safe else urllib.parse.quote(rid, safe="")}


def sampling_params(
    state: ServerState, body: GenerationFields, *, max_tokens: int | None, logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    _reject_unsupported(body)
    cap = state.config.engine.max_num_seqs
    if body.n > cap:
        raise bad_request(f"n must be at most {cap} (engine.max_num_seqs), got {body.n}", "n")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    try:
        return SamplingParams(
            n=body.n, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            seed=body.seed, max_tokens=max_tokens, min_tokens=body.min_tokens, stop=body.stop or [],
            stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
            forced_token_ids=forced_token_ids(state, body.model_extra or {}),
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, logit_bias=logit_bias(body.logit_bias),
            kv_transfer_params=kv_transfer_params(body.kv_transfer_params, (body.model_extra or {}).get("extra_args")),
            structured_outputs=checked(state.engine, constraint(body.model_extra or {})),
            allowed_token_ids=allowed_token_ids(body.model_extra or {}),
        )
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None


def kv_transfer_params(top: Any, extra_args: Any) -> dict[str, Any] | None:
    """P/D (wire-protocols §1.2): top-level, or inside `extra_args` as prime-rl threads it; top-level wins."""
    if top is None and isinstance(extra_args, dict):
        top = extra_args.get("kv_transfer_params")
    if top is not None and not isinstance(top, dict):
        raise bad_request("kv_transfer_params must be an object or null", "kv_transfer_params")
    return top


def logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); biases are clamped to [-100, 100] (vLLM)."""
    if not bias:
        return None
    try:
        parsed = {int(k): float(v) for k, v in bias.items()}
    except (AttributeError, TypeError, ValueError):
        raise bad_request("logit_bias must map token ids to numbers", "logit_bias") from None
    if not all(math.isfinite(v) for v in parsed.values()):
        raise bad_request("logit_bias values must be finite numbers", "logit_bias")
    return {k: min(max(v, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT) for k, v in parsed.items()}


def forced_token_ids(state: ServerState, extra: dict[str, Any]) -> list[int] | None:
    """Test-only `vllm_xargs.forced_token_ids`, honoured when the server allows it."""
    forced = (extra.get("vllm_xargs") or {}).get("forced_token_ids") if isinstance(extra.get("vllm_xargs"), dict) else None
    if forced is None:
        return None
    if not state.config.engine.allow_forced_tokens:
        raise bad_request("forced_token_ids needs a server started with --engine.allow-forced-tokens", "vllm_xargs")
    return forced


def _reject_unsupported(body: GenerationFields) -> None:
    """Known fields the engine cannot honour yet: refuse rather than silently sample differently."""
    extra = body.model_extra or {}
    if extra.get("bad_words"):
        raise bad_request("bad_words is not supported yet; omit it", "bad_words")


def truncate(ids: list[int], k: int | None, max_model_len: int) -> list[int]:
    """`truncate_prompt_tokens`: keep the last k tokens (-1 = the context length)."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {k}", "truncate_prompt_tokens")
    return ids[-k:]


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """The engine's input checks become 400s naming the field; a dead engine loop is a 503."""
    try:
        yield
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # the body has been read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Run:
    """The engine requests of one HTTP request (one per prompt), consumed as one event stream."""

    def __init__(self, state: ServerState, prompts: list[list[int]], params: SamplingParams, rid: str,
                 cache_salt: str | None, adapter: str | None = None, stream: bool = True):
        check_request_caps(state, params)
        self.state, self.n = state, params.n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = [asyncio.Event() for _ in prompts]
        self._errors: list[BaseException | None] = [None] * len(prompts)
        # one id for all prompts: an abort by id reaches every one of them
        self._tasks = [asyncio.create_task(self._pump(i, p, params, rid, cache_salt, adapter, stream))
                       for i, p in enumerate(prompts)]

    async def _pump(self, i: int, prompt: list[int], params: SamplingParams, rid: str, salt: str | None,
                    adapter: str | None, stream: bool) -> None:
        timer, last = self.state.metrics.timer(), None
        try:
            async for out in self.state.engine.generate(prompt, params, rid, cache_salt=salt, adapter=adapter,
                                                        stream=stream):
                timer.step(out)
                last = out
                self._started[i].set()
                self._queue.put_nowait((i, out))
        except ValueError as e:  # rejected before it was queued: not a request for the metrics
            self._fail(i, e)
            return
        except BaseException as e:
            timer.end(last, self.n)
            self._fail(i, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        timer.end(last, self.n)

    def _fail(self, i: int, exc: BaseException) -> None:
        self._errors[i] = exc
        self._started[i].set()
        self._queue.put_nowait((i, exc))

    async def started(self) -> None:
        """Wait until every prompt was accepted (its first output arrived); raise the first rejection."""
        for event in self._started:
            await event.wait()
        for err in self._errors:
            if err is not None:
                raise err

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._tasks)
        while remaining:
            i, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            remaining -= item.finished
            yield i, item

    async def collect(self) -> list[RequestOutput]:
        finals: list[RequestOutput] = [None] * len(self._tasks)  # type: ignore[list-item]
        async for i, out in self.events():
            finals[i] = out
        return finals

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def run_to_end(request: Request, run: Run) -> list[RequestOutput]:
    try:
        with engine_errors():
            return await until_disconnected(request, run.collect())
    finally:
        await run.close()


async def start_stream(request: Request, run: Run) -> None:
    """Return once every prompt is accepted, so a rejection can still be a 4xx instead of a 200 stream."""
    try:
        with engine_errors():
            await until_disconnected(request, run.started())
    except BaseException:
        await run.close()
        raise


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # a client that left while a chunk was being sent: close the generator now, not at GC
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[str], run: Run) -> AsyncIterator[str]:
    """SSE chunks, then `[DONE]`. A failure after the 200 went out can only be told in-band."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # the 200 is gone: tell the client in-band; bugs are logged
        if not isinstance(e, (APIError, EngineDeadError)):
            log.exception("stream failed")
        yield sse_error(e)
    finally:
        await run.close()
    yield SSE_DONE


def sse_error(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, EngineDeadError):
        err = APIError(503, str(exc))
    else:
        err = APIError(500, f"internal server error: {exc!r}", type="InternalServerError")
    return sse(err.body())


def clamp(lp: float) -> float:
    return NEG_INF_JSON if lp == -math.inf or math.isnan(lp) else lp


def sampled_first(token_id: int, logprob: float, top: dict[int, float]) -> list[tuple[int, float]]:
    """vLLM's top_logprobs list: the sampled token first, then the best others, as many as were asked."""
    return ([(token_id, logprob)] + [(t, v) for t, v in top.items() if t != token_id])[: len(top)]


def version_fields(state: ServerState, out: CompletionOutput) -> dict[str, Any]:
    """rlserve extensions (§2.15) carried by every choice: each span keeps the label it was produced under."""
    policy = out.policy_version if out.policy_version is not None else state.engine.policy_version
    return {
        "policy_version": policy,
        "weight_version": out.weight_version or weight_version(state.engine),
        "weight_versions": [
            {"version": s.weight_version, "policy_version": s.policy_version, "start": s.start, "end": s.end}
            for s in out.version_spans
        ],
    }


def prompt_logprobs_json(state: ServerState, out: RequestOutput, k: int | None, as_ids: bool) -> list | None:
    """§2.2 shape: null first, then {"<id>": {logprob, rank, decoded_token}} with the prompt token + k best."""
    if k is None or out.prompt_logprobs is None:
        return None
    result: list[dict | None] = []
    ranks = out.prompt_logprob_ranks or [None] * len(out.prompt_logprobs)
    for pos, (entry, entry_ranks) in enumerate(zip(out.prompt_logprobs, ranks)):
        if entry is None:
            result.append(None)
            continue
        actual = out.prompt_token_ids[pos]
        result.append({
            str(t): {"logprob": clamp(lp), "rank": entry_ranks[t], "decoded_token": state.token_label(t, as_ids)}
            for t, lp in entry.items()
            if t == actual or k == -1 or entry_ranks[t] <= k
        })
    return result


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has already sent."""

    tokens: int = 0
    text: int = 0
    offset: int = 0  # text_offset of the next token (completions logprobs)
    started: bool = False
    finished: bool = False
