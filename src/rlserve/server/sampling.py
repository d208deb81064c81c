"""A request's sampling fields (OpenAI, vLLM and rlserve extras) checked and turned into SamplingParams."""

from __future__ import annotations

import math
from typing import Any

from rlserve.engine.params import SamplingParams
from rlserve.server.errors import bad_request, from_value_error
from rlserve.server.protocol import GenerationFields
from rlserve.server.state import SAMPLING_FIELDS, ServerState
from rlserve.server.structured_request import allowed_token_ids, checked, constraint

LOGIT_BIAS_LIMIT = 100.0


def sampling_params(
    state: ServerState,
    body: GenerationFields,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    _reject_unsupported(body)
    cap = state.config.engine.max_num_seqs
    if body.n > cap:
        raise bad_request(f"n must be at most {cap} (engine.max_num_seqs), got {body.n}", "n")
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options can only be defined when stream=true: drop it, or stream", "stream_options")
    if body.prompt_logprobs is not None and body.stream:
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    try:
        return SamplingParams(
            n=body.n,
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            seed=body.seed,
            max_tokens=max_tokens,
            min_tokens=body.min_tokens,
            stop=body.stop or [],
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
            forced_token_ids=forced_token_ids(state, body.model_extra or {}),
            repetition_penalty=body.repetition_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=logit_bias(body.logit_bias),
            kv_transfer_params=kv_transfer_params(body.kv_transfer_params, (body.model_extra or {}).get("extra_args")),
            structured_outputs=checked(state.engine, constraint(body.model_extra or {})),
            allowed_token_ids=allowed_token_ids(body.model_extra or {}),
        )
    except ValueError as e:
        raise from_value_error(e, SAMPLING_FIELDS) from None


def kv_transfer_params(top: Any, extra_args: Any) -> dict[str, Any] | None:
    """P/D (docs/protocols.md §1.2): top-level, or inside `extra_args` as prime-rl threads it; top-level wins."""
    if top is None and isinstance(extra_args, dict):
        top = extra_args.get("kv_transfer_params")
    if top is not None and not isinstance(top, dict):
        raise bad_request("kv_transfer_params must be an object or null", "kv_transfer_params")
    return top


def logit_bias(bias: dict | None) -> dict[int, float] | None:
    """OpenAI sends token ids as JSON object keys (strings); biases are clamped to [-100, 100] (vLLM)."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise bad_request("logit_bias must map token ids to numbers", "logit_bias")
    bad_keys = [k for k in bias if not str(k).lstrip("-").isdigit()]
    if bad_keys:
        raise bad_request(f"logit_bias keys must be token ids (integers); not token ids: {bad_keys}", "logit_bias")
    try:
        parsed = {int(k): float(v) for k, v in bias.items()}
    except (AttributeError, TypeError, ValueError):
        raise bad_request("logit_bias must map token ids to numbers", "logit_bias") from None
    if not all(math.isfinite(v) for v in parsed.values()):
        raise bad_request("logit_bias values must be finite numbers", "logit_bias")
    return {k: min(max(v, -LOGIT_BIAS_LIMIT), LOGIT_BIAS_LIMIT) for k, v in parsed.items()}


def forced_token_ids(state: ServerState, extra: dict[str, Any]) -> list[int] | None:
    """Test-only `vllm_xargs.forced_token_ids`, honoured when the server allows it."""
    forced = (
        (extra.get("vllm_xargs") or {}).get("forced_token_ids") if isinstance(extra.get("vllm_xargs"), dict) else None
    )
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
    if extra.get("thinking_token_budget") is not None:
        raise bad_request(
            "thinking_token_budget is not supported: bound the whole answer with max_tokens", "thinking_token_budget"
        )
    if body.use_beam_search:
        raise bad_request(
            "use_beam_search is not supported: this server samples; omit it or send false", "use_beam_search"
        )
    if body.logprob_token_ids:
        raise bad_request(
            "logprob_token_ids is not supported; ask for top_logprobs (-1: the whole vocabulary, on a server started "
            "with --engine.max_logprobs -1) and read those ids",
            "logprob_token_ids",
        )


def full_vocabulary(state: ServerState, k: int | None, field: str) -> int | None:
    """vLLM's -1 for logprobs / top_logprobs: every token of the vocabulary, within engine.max_logprobs."""
    if k != -1:
        return k
    cap = state.config.engine.max_logprobs
    if cap != -1 and cap < state.engine.vocab_size:
        raise bad_request(
            f"{field}=-1 asks for the whole vocabulary ({state.engine.vocab_size} tokens), more than this server's "
            f"max_logprobs ({cap}); send at most {cap}, or start the server with --engine.max_logprobs -1",
            field,
        )
    return state.engine.vocab_size


def truncate(ids: list[int], k: int | None, max_model_len: int, side: str | None = None) -> list[int]:
    """`truncate_prompt_tokens`: keep the last k tokens (-1 = the context length); the first k with
    `truncation_side` "right"."""
    if k is None:
        return ids
    if k == -1:
        k = max_model_len
    if k < 1:
        raise bad_request(f"truncate_prompt_tokens must be -1 or >= 1, got {k}", "truncate_prompt_tokens")
    return ids[:k] if side == "right" else ids[-k:]
