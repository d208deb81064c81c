"""What every route group shares: the server state, reading a request's JSON body and id, turning engine
errors into HTTP ones, and the rlserve fields every choice carries. Sampling fields are sampling.py; running
and streaming engine requests is streaming.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from rlserve.config.schema import Config
from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.runtime.face import EngineDeadError, EngineFace
from rlserve.server.errors import APIError, bad_request, from_value_error
from rlserve.server.metrics import Metrics, weight_version
from rlserve.server.protocol import Body

T = TypeVar("T")
NEG_INF_JSON = -9999.0  # vLLM's clamp: JSON has no -inf
SAMPLING_FIELDS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "top_logprobs", "max_completion_tokens"}


@dataclass
class ServerState:
    engine: EngineFace
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
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="rlserve-tokenize")
    )
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
        raise APIError(
            404,
            f"the model `{model}` does not exist; this server serves `{self.served_model_name}`",
            param="model",
            type="NotFoundError",
        )

    def check_adapter(self, name: str, param: str) -> str:
        """A loaded adapter by name (or the path it was loaded from); 404 otherwise, never the base model."""
        adapters = self.engine.adapters  # name -> path
        if name in adapters:
            return name
        for known, path in adapters.items():
            if path == name:
                return known
        raise APIError(
            404,
            f"LoRA adapter `{name}` is not loaded; load it first or drop {param}",
            param=param,
            type="NotFoundError",
        )

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
            high = (
                base + int(fields["max_staleness"]) if high is None else min(high, base + int(fields["max_staleness"]))
            )
        if low is not None and current < low:
            raise APIError(
                409,
                f"server policy_version {current} is older than min_policy_version {low}",
                param="min_policy_version",
                type="ConflictError",
            )
        if high is not None and current > high:
            raise APIError(
                409,
                f"server policy_version {current} is newer than allowed ({high})",
                param="max_policy_version",
                type="ConflictError",
            )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id])
            # part of a multi-byte character: vLLM shows such a token as "" in logprobs
            text = self._token_text[token_id] = "" if text.endswith("\ufffd") else text
        return text

    def token_label(self, token_id: int, as_ids: bool) -> str:
        as_ids = as_ids or self.config.server.return_tokens_as_token_ids  # vLLM: the request's or the server's
        return f"token_id:{token_id}" if as_ids else self.token_text(token_id)

    def check_token_ids(self, ids: list[int], what: str) -> None:
        vocab = self.engine.vocab_size
        for t in ids:
            if not 0 <= t < vocab:
                raise bad_request(f"token id {t} is out of vocabulary (ids run 0 to {vocab - 1}) in {what}", what)


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
    return (
        request.headers.get("x-request-id")
        or getattr(body, "request_id", None)
        or getattr(body, "rid", None)
        or uuid.uuid4().hex
    )


def rid_header(rid: str) -> dict[str, str]:
    """The id echoed in X-Request-Id; headers carry printable ASCII only, so anything else is %-encoded."""
    safe = rid.isascii() and rid.isprintable()
    return {"X-Request-Id": rid if safe else urllib.parse.quote(rid, safe="")}


@contextlib.contextmanager
def engine_errors() -> Iterator[None]:
    """The engine's input checks become 400s naming the field; a dead engine loop is a 503."""
    try:
        yield
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None
    except EngineDeadError as e:
        raise APIError(503, str(e)) from None


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
        result.append(
            {
                str(t): {"logprob": clamp(lp), "rank": entry_ranks[t], "decoded_token": state.token_label(t, as_ids)}
                for t, lp in entry.items()
                if t == actual or k == -1 or entry_ranks[t] <= k
            }
        )
    return result


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """vLLM's keys; prompt_tokens_details is null unless cached_tokens is given (cached_tokens())."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": None if cached_tokens is None else {"cached_tokens": cached_tokens},
        "completion_tokens_details": None,
    }


def cached_tokens(state: ServerState, count: int) -> int | None:
    """The prefix-cache hits usage reports: only with server.enable_prompt_tokens_details (vLLM's default off)."""
    return count if state.config.server.enable_prompt_tokens_details else None


def usage_switches(state: ServerState, options: Any) -> tuple[bool, bool]:
    """(a usage chunk at the end, usage on every chunk) of a stream: as its stream_options ask, or both with
    server.enable_force_include_usage (vLLM's --enable-force-include-usage)."""
    if state.config.server.enable_force_include_usage:
        return True, True
    include = bool(options and options.include_usage)
    return include, include and bool(options.continuous_usage_stats)


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has already sent."""

    tokens: int = 0
    text: int = 0
    offset: int = 0  # text_offset of the next token (completions logprobs)
    started: bool = False
    finished: bool = False
