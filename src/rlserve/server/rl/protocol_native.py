"""Bodies of the token-in/token-out routes: /inference/v1/generate and the shared /generate path
(TRL legacy, SGLang, MLX-style; docs/protocols.md §2.0 dispatch). Every sampling field defaults to null,
so a protocol's own defaults (TRL max_tokens 16, SGLang 128, MLX temperature 0) apply when it is absent."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlserve.server.protocol import Body, PolicyWindow, bound


class SamplingFields(Body):
    """The §2.1 set under SamplingParams names (vLLM `sampling_params`, TRL top level and generation_kwargs)."""

    n: int | None = bound(None, minimum=1)
    temperature: float | None = bound(None, minimum=0)
    top_p: float | None = bound(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = bound(None, minimum=-1)
    min_p: float | None = bound(None, minimum=0, maximum=1)
    repetition_penalty: float | None = bound(None, exclusiveMinimum=0)
    presence_penalty: float | None = bound(None, minimum=-2, maximum=2)
    frequency_penalty: float | None = bound(None, minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    max_tokens: int | None = bound(None, minimum=1)
    min_tokens: int | None = bound(None, minimum=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = bound(None, minimum=0)
    prompt_logprobs: int | None = bound(None, minimum=-1)
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    return_tokens_as_token_ids: bool | None = None


class InferenceGenerateRequest(PolicyWindow):
    """`POST /inference/v1/generate` (§2.6)."""

    model: str | None = None
    token_ids: list[int] = Field(json_schema_extra={"minItems": 1})
    sampling_params: SamplingFields | None = None
    request_id: str | None = None
    cache_salt: str | None = None
    stream: bool = False
    priority: int = 0
    return_tokens_as_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class TRLGenerateRequest(SamplingFields, PolicyWindow):
    """TRL legacy `POST /generate/` (§2.11.4): told apart by `prompts`."""

    prompts: list[str | list[int]] | str = Field(json_schema_extra={"minItems": 1})
    truncate_prompt_tokens: int | None = bound(None, minimum=1)
    structured_outputs_regex: str | None = None
    generation_kwargs: SamplingFields | None = None


class SGLangSamplingParams(SamplingFields):
    max_new_tokens: int | None = bound(None, minimum=1)


class SGLangGenerateRequest(PolicyWindow):
    """SGLang-native `POST /generate` (§2.11.6): told apart by `input_ids`, `text` or `sampling_params`."""

    input_ids: list[int] | list[list[int]] | None = None
    text: str | list[str] | None = None
    sampling_params: SGLangSamplingParams | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int | None = bound(None, minimum=0)
    return_text_in_logprobs: bool = False
    stream: bool = False
    lora_path: str | None = None
    rid: str | None = None
    return_routed_experts: bool = False


class MLXGenerateRequest(SamplingFields, PolicyWindow):
    """MLX-style RL server `POST /generate` (§2.8): told apart by `prompt`."""

    prompt: str | list[str] | list[int]
    repetition_context_size: int | None = bound(None, minimum=1)
    step_id: int | str | None = None
    request_id: str | None = None


GENERATE_BODIES = (TRLGenerateRequest, SGLangGenerateRequest, MLXGenerateRequest)


def generate_body_model(body: dict) -> type[Body] | None:
    """§2.0: `prompts` → TRL legacy; `input_ids`, `text` or `sampling_params` → SGLang; `prompt` → MLX."""
    if "prompts" in body:
        return TRLGenerateRequest
    if {"input_ids", "text", "sampling_params"} & body.keys():
        return SGLangGenerateRequest
    if "prompt" in body:
        return MLXGenerateRequest
    return None
