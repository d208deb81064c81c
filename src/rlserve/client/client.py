"""`InferenceClient`: the async Python client for one or several rlserve servers.

What it guarantees about weight versions (unless a call passes allow_mixed_versions=True):
- a generation started while an update through this client runs (update_weights, load_adapter,
  or between pause() and resume()) is held until the update finished on every endpoint, so it
  is produced by the new weights alone; after weight_sync_timeout it raises WeightSyncTimeout;
- a generation is not sent to an endpoint seen paused (someone else is syncing) until it resumes,
  nor to one that now reports an older policy than it served before (it restarted);
- generations already running when an update starts are the server's business: update_weights
  pauses with mode "wait" by default (they finish on the old weights), "keep" (they finish on the
  new ones: several spans, Sample.mixed_versions) or "abort" (finish_reason "abort").
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from rlserve.client.endpoints import Endpoint
from rlserve.client.errors import AdminError, ContextLengthExceeded
from rlserve.client.sample import Sample
from rlserve.client.transport import Transport

OVERFLOW_MODES = ("raise", "truncate_sample")
PAUSE_MODES = ("keep", "abort", "wait")


class InferenceClient:
    """Async client. `base_urls` is one URL or several replicas (with or without a trailing /v1).

    Calls with a `session_id` stick to one endpoint (rendezvous hashing over the healthy ones, sent
    as X-Session-ID); other calls go to the endpoint with the fewest calls open from this client.
    Connection errors and 5xx are retried with jittered exponential backoff until retry_deadline,
    on another endpoint when there is one; 4xx raise at once. Admin calls go to every endpoint, or
    only to `admin_url` when given (a deployment's admin address, which reaches every replica).
    """

    def __init__(
        self,
        base_urls: str | Sequence[str] = "http://127.0.0.1:8000",
        *,
        model: str | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 600.0,
        retry_deadline: float = 120.0,
        backoff_base: float = 0.1,
        backoff_max: float = 5.0,
        probe_interval: float = 5.0,
        weight_sync_timeout: float = 600.0,
        allow_mixed_versions: bool = False,
        on_overflow: str = "raise",
        max_connections: int = 512,
        admin_url: str | None = None,
    ):
        if on_overflow not in OVERFLOW_MODES:
            raise ValueError(f"on_overflow must be one of {OVERFLOW_MODES}, got {on_overflow!r}")
        urls = [base_urls] if isinstance(base_urls, str) else list(base_urls)
        self.model, self.allow_mixed_versions, self.on_overflow = model, allow_mixed_versions, on_overflow
        self.transport = Transport(
            urls,
            api_key=api_key,
            admin_api_key=admin_api_key,
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            retry_deadline=retry_deadline,
            backoff_base=backoff_base,
            backoff_max=backoff_max,
            probe_interval=probe_interval,
            weight_sync_timeout=weight_sync_timeout,
            max_connections=max_connections,
            admin_url=admin_url,
        )
        self.completions = Completions(self, "/v1/completions")
        self.chat = Chat(self)

    @property
    def base_urls(self) -> list[str]:
        return self.transport.urls

    # ---- RL sampling -----------------------------------------------------------------------------

    async def generate(
        self,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        *,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        return_text: bool = True,
        sampling_params: dict[str, Any] | None = None,
        min_policy_version: int | None = None,
        allow_mixed_versions: bool | None = None,
        on_overflow: str | None = None,
        policy_version: int | None = None,
        step_id: Any = None,
    ) -> Sample:
        """Token in, token out through /inference/v1/generate. A string prompt is tokenized by the
        server (/tokenize), so ids and template always agree. max_tokens=None lets the completion run
        to the end of the context. `sampling_params` adds or overrides any §2.1 field.
        min_policy_version: a server still on an older policy answers 409 (ConflictError).
        policy_version / step_id (the MLX client's): the trainer's bookkeeping, sent along; Sample.step_id
        echoes step_id, while Sample.policy_version stays the version that produced the sample."""
        (sample,) = await self.generate_group(**_arguments(locals()), n=1)
        return sample

    async def generate_group(
        self,
        prompt: str | None = None,
        token_ids: list[int] | None = None,
        *,
        n: int,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        seed: int | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        return_text: bool = True,
        sampling_params: dict[str, Any] | None = None,
        min_policy_version: int | None = None,
        allow_mixed_versions: bool | None = None,
        on_overflow: str | None = None,
        policy_version: int | None = None,
        step_id: Any = None,
    ) -> list[Sample]:
        """`generate` with n samples of one prompt (a GRPO group) in one request: they share the
        prompt's KV cache and come back in order, each a Sample (overflow: n empty ones)."""
        if (prompt is None) == (token_ids is None):
            raise ValueError("pass exactly one of prompt (a string) or token_ids")
        if token_ids is None:
            token_ids = await self.tokenize(prompt, add_special_tokens=add_special_tokens, session_id=session_id)
        params = {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "min_p": min_p,
            "logprobs": 0,
            "max_tokens": max_tokens,
            "stop": stop,
            "stop_token_ids": stop_token_ids,
            "seed": seed,
            "n": n,
        }
        params = {k: v for k, v in params.items() if v is not None} | (sampling_params or {})
        body = _compact(
            {
                "token_ids": list(token_ids),
                "sampling_params": params,
                "model": self.model,
                "request_id": request_id,
                "cache_salt": cache_salt,
                "min_policy_version": min_policy_version,
                "policy_version": policy_version,
                "step_id": step_id,
            }
        )
        try:
            data, ep = await self._generation("/inference/v1/generate", body, session_id, allow_mixed_versions)
        except ContextLengthExceeded as exc:
            return [self._overflow(exc, on_overflow) for _ in range(n)]
        samples = []
        for choice in sorted(data["choices"], key=lambda c: c["index"]):
            ids = choice.get("token_ids") or []
            text = await self.detokenize(ids, session_id=session_id) if return_text and ids else ""
            samples.append(Sample.from_choice(choice, token_ids, text, ep.url))
            samples[-1].step_id = data.get("step_id", step_id)
            samples[-1].request_id = data.get("request_id", request_id)
        return samples

    async def _chat(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        stop: str | list[str] | None = None,
        seed: int | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        session_id: str | None = None,
        request_id: str | None = None,
        cache_salt: str | None = None,
        extra_body: dict[str, Any] | None = None,
        min_policy_version: int | None = None,
        allow_mixed_versions: bool | None = None,
        on_overflow: str | None = None,
    ) -> Sample:
        """One chat turn as a Sample: the server's prompt ids (template applied), completion ids,
        their logprobs, and the parsed message (content, tool_calls, reasoning) in Sample.message."""
        body = _compact(
            {
                "messages": messages,
                "tools": tools,
                "max_tokens": max_tokens,
                "temperature": temperature,
                "top_p": top_p,
                "top_k": top_k,
                "min_p": min_p,
                "stop": stop,
                "seed": seed,
                "chat_template_kwargs": chat_template_kwargs,
                "model": self.model,
                "request_id": request_id,
                "cache_salt": cache_salt,
                "logprobs": True,
                "return_token_ids": True,
                "min_policy_version": min_policy_version,
            }
        ) | (extra_body or {})
        try:
            data, ep = await self._generation("/v1/chat/completions", body, session_id, allow_mixed_versions)
        except ContextLengthExceeded as exc:
            return self._overflow(exc, on_overflow)
        choice = data["choices"][0]
        content = (choice.get("message") or {}).get("content") or ""
        return Sample.from_choice(choice, data.get("prompt_token_ids") or [], content, ep.url)

    async def _generation(
        self, path: str, body: dict[str, Any], session_id: str | None, allow_mixed_versions: bool | None
    ) -> tuple[Any, Endpoint]:
        allow = self.allow_mixed_versions if allow_mixed_versions is None else allow_mixed_versions
        return await self.transport.call(
            "POST", path, json=body, session_id=session_id, generation=True, allow_mixed_versions=allow
        )

    def _overflow(self, exc: ContextLengthExceeded, mode: str | None) -> Sample:
        mode = mode or self.on_overflow
        if mode not in OVERFLOW_MODES:
            raise ValueError(f"on_overflow must be one of {OVERFLOW_MODES}, got {mode!r}")
        if mode == "raise":
            raise exc
        return Sample.overflow(exc.url)

    # ---- tokenizer ---------------------------------------------------------------------------

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        session_id: str | None = None,
    ) -> list[int]:
        """A string (add_special_tokens defaults to true) or a conversation rendered exactly as chat does."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        body = _compact(
            {
                "model": self.model,
                "prompt": prompt,
                "messages": messages,
                "tools": tools,
                "add_special_tokens": add_special_tokens,
                "chat_template_kwargs": chat_template_kwargs,
            }
        )
        if messages is not None:
            body |= {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message}
        data, _ = await self.transport.call("POST", "/tokenize", json=body, session_id=session_id)
        return data["tokens"]

    async def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **chat_template_kwargs: Any,
    ) -> list[int]:
        """Hugging Face's `apply_chat_template(..., tokenize=True)`, rendered by the server; extra
        keyword arguments reach the template (e.g. enable_thinking=False)."""
        return await self.tokenize(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs or None,
        )

    async def detokenize(self, token_ids: list[int], *, session_id: str | None = None) -> str:
        body = _compact({"model": self.model, "tokens": list(token_ids)})
        data, _ = await self.transport.call("POST", "/detokenize", json=body, session_id=session_id)
        return data["prompt"]

    async def rescore(self, sample: Sample, *, session_id: str | None = None) -> dict[str, Any]:
        """Score a finished sample again, alone, at the version that produced it (POST /v1/rescore) and
        return the report of logprobs that differ. Raises BadRequest (409) when the server has moved
        to another version, or, under engine.batch_invariant, when any logprob differs at all."""
        body = _compact(
            {
                "model": self.model,
                "prompt_ids": list(sample.prompt_ids),
                "completion_ids": list(sample.completion_ids),
                "logprobs": list(sample.logprobs),
                "policy_version": None if sample.mixed_versions else sample.policy_version,
            }
        )
        data, _ = await self.transport.call("POST", "/v1/rescore", json=body, session_id=session_id)
        return data

    # ---- control: every endpoint ---------------------------------------------------------------

    async def update_weights(
        self, weight_dir: str, *, pause_mode: str | None = "wait", weight_version: str | None = None
    ) -> dict[str, int]:
        """Load a safetensors directory on every endpoint; returns each one's new policy_version.
        pause_mode decides what happens to generations already running (module docstring); None
        lets each server quiesce by itself (as "keep"). Raises AdminError if any endpoint failed."""
        return await self._mutate(
            "/update_weights", _compact({"weight_dir": weight_dir, "weight_version": weight_version}), pause_mode
        )

    async def load_adapter(
        self, name: str, path: str | None = None, *, pause_mode: str | None = "wait"
    ) -> dict[str, Any]:
        """Load (or reload in place) a LoRA adapter (PEFT or mlx-lm layout) on every endpoint; select it with
        model=name; returns each endpoint's new policy_version. With the path alone (`load_adapter(path)`,
        the MLX client's call): every request of the base model uses it from now on, and the answer is
        {"status", "policy_version", "message", "policy_versions": {endpoint: version}}."""
        if path is None:
            versions = await self._mutate("/load_adapter", {"adapter_path": name}, pause_mode)
            return {
                "status": "success",
                "policy_version": max(versions.values()),
                "message": f"Loaded adapter from {name}",
                "policy_versions": versions,
            }
        return await self._mutate("/load_lora_adapter", {"lora_name": name, "lora_path": path}, pause_mode)

    async def unload_adapter(self, name: str) -> dict[str, Any]:
        return _checked(
            "unload_adapter",
            await self.transport.broadcast("POST", "/v1/unload_lora_adapter", json={"lora_name": name}),
        )

    async def pause(self, mode: str = "keep") -> dict[str, Any]:
        """Pause every endpoint; this client also holds its new generations until resume()."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {PAUSE_MODES}, got {mode!r}")
        self.transport.set_held(True)
        return _checked("pause", await self.transport.broadcast("POST", "/pause", params={"mode": mode}))

    async def resume(self) -> dict[str, Any]:
        try:
            return _checked("resume", await self._resume_all())
        finally:
            self.transport.set_held(False)

    async def health(self) -> dict[str, bool]:
        """Probe every endpoint now; True where it is up."""
        await self.transport.probe_all()
        return {e.url: e.up for e in self.transport.pool.endpoints}

    async def metrics(self) -> dict[str, dict[str, Any]]:
        """Each endpoint's JSON status: current_policy_version, queue_depth, num_running, is_paused, ..."""
        return _checked(
            "metrics", await self.transport.broadcast("GET", "/metrics", params={"format": "json"}, admin=False)
        )

    async def models(self) -> dict[str, Any]:
        data, _ = await self.transport.call("GET", "/v1/models")
        return data

    async def _mutate(self, path: str, body: dict[str, Any], pause_mode: str | None) -> dict[str, int]:
        if pause_mode is not None and pause_mode not in PAUSE_MODES:
            raise ValueError(f"pause_mode must be one of {PAUSE_MODES} or None, got {pause_mode!r}")
        t = self.transport
        pause = pause_mode is not None and not t.held  # inside pause()/resume() the caller owns the pause
        steps: dict[str, dict[str, Any]] = {}
        async with t.syncing():
            if pause:
                steps["pause"] = await t.broadcast("POST", "/pause", params={"mode": pause_mode})
            try:
                steps["update"] = results = await t.broadcast("POST", path, json=body)
                for url, r in results.items():
                    if isinstance(r, dict) and isinstance(r.get("policy_version"), int):
                        for ep in t.governed(url):
                            ep.committed(r["policy_version"])
            finally:
                if pause:
                    steps["resume"] = await self._resume_all()
        failed = {f"{step} {url}": r for step, rs in steps.items() for url, r in rs.items() if isinstance(r, Exception)}
        if failed:
            details = "; ".join(f"{k}: {v}" for k, v in failed.items())
            raise AdminError(f"{path} failed on {len(failed)} call(s): {details}", steps.get("update", {}))
        return {url: r["policy_version"] for url, r in results.items()}

    async def _resume_all(self) -> dict[str, Any]:
        results = await self.transport.broadcast("POST", "/resume")
        for url, r in results.items():
            if not isinstance(r, Exception):  # don't wait for the next probe to learn it
                for ep in self.transport.governed(url):
                    ep.paused = False
        return results

    # ---- lifetime ------------------------------------------------------------------------------

    async def close(self) -> None:
        await self.transport.aclose()

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


class Completions:
    """`client.completions.create(...)` / `client.chat.completions.create(...)`: the OpenAI call with
    vLLM extras passed through (top level or in extra_body); returns the response JSON as a dict.
    Routed, retried and held during weight syncs like every generation. With stream=True it returns an
    async iterator of the SSE chunks (dicts): retried until the first chunk arrives; a stream cut after
    that raises StreamInterrupted (retryable: send the request again), never a silent restart."""

    def __init__(self, client: InferenceClient, path: str):
        self._client, self._path = client, path

    async def create(
        self,
        *,
        session_id: str | None = None,
        allow_mixed_versions: bool | None = None,
        extra_body: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> dict[str, Any] | AsyncIterator[dict[str, Any]]:
        body = _compact({"model": self._client.model}) | kwargs | (extra_body or {})
        if body.get("stream"):
            allow = self._client.allow_mixed_versions if allow_mixed_versions is None else allow_mixed_versions
            return self._client.transport.stream(
                self._path, json=body, session_id=session_id, allow_mixed_versions=allow
            )
        data, _ = await self._client._generation(self._path, body, session_id, allow_mixed_versions)
        return data


class Chat:
    """`client.chat(messages, ...)` samples one turn (see InferenceClient._chat for the arguments);
    `client.chat.completions.create(...)` is the OpenAI call."""

    def __init__(self, client: InferenceClient):
        self._client = client
        self.completions = Completions(client, "/v1/chat/completions")

    async def __call__(self, messages: list[dict[str, Any]], **kwargs: Any) -> Sample:
        return await self._client._chat(messages, **kwargs)


def _arguments(method_locals: dict[str, Any]) -> dict[str, Any]:
    """A method's arguments, from its locals() taken before it binds anything else, to hand on whole."""
    return {k: v for k, v in method_locals.items() if k != "self"}


def _compact(d: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in d.items() if v is not None}


def _checked(what: str, results: dict[str, Any]) -> dict[str, Any]:
    failed = {url: r for url, r in results.items() if isinstance(r, Exception)}
    if failed:
        raise AdminError(
            f"{what} failed on {len(failed)} of {len(results)} endpoints: "
            + "; ".join(f"{url}: {r}" for url, r in failed.items()),
            results,
        )
    return results
