"""Request bodies. Unknown fields are kept and ignored (never 4xx); ranges are checked by the engine."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        # routers and SDKs send explicit nulls for fields they did not set
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required():
            return field.get_default(call_default_factory=True)
        return value


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationFields(Body):
    """Fields shared by /v1/completions and /v1/chat/completions (wire-protocols §2.1)."""

    model: str | None = None
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    prompt_logprobs: int | None = None
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    request_id: str | None = None
    rid: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(GenerationFields):
    prompt: Any = None  # str | [str] | [int] | [[int]], checked in completions.py for a clearer message
    echo: bool = False
    logprobs: bool | int | None = None
    add_special_tokens: bool = True


class ContentPart(Body):
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    # an earlier turn's exact tokens (§2.3 token splice): all of the first two or none
    prompt_token_ids: list[int] | None = None
    generation_token_ids: list[int] | None = None
    generation_log_probs: list[float] | None = None


class ChatTemplateFields(Body):
    """How a conversation becomes a prompt; shared by chat and /tokenize."""

    messages: list[ChatMessage] | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatCompletionRequest(ChatTemplateFields, GenerationFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None
    tool_choice: str | dict[str, Any] | None = None
    include_reasoning: bool = True


class ChatTokensRequest(ChatCompletionRequest):
    tokens: list[int]


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None  # prompt form only (default true); messages render as in chat
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]


class ResponsesRequest(GenerationFields):
    """`POST /v1/responses` (§2.9); converted to a chat request in `responses_input`."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = None
    metadata: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    text: dict[str, Any] | None = None
    truncation: str | None = None
    previous_response_id: str | None = None
    include_reasoning: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    replace_developer_role_with_system: bool = False

    @model_validator(mode="before")
    @classmethod
    def _metadata_extras(cls, data: Any) -> Any:
        # NeMo Gym convention: JSON strings metadata.extra_body / metadata.chat_template_kwargs; request fields win
        meta = data.get("metadata") if isinstance(data, dict) else None
        if not isinstance(meta, dict):
            return data
        merged = {**_json_object(meta.get("extra_body"), "metadata.extra_body"), **data}
        kwargs = _json_object(meta.get("chat_template_kwargs"), "metadata.chat_template_kwargs")
        if kwargs:
            merged["chat_template_kwargs"] = {**kwargs, **(data.get("chat_template_kwargs") or {})}
        return merged


def _json_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, str):
        return {}
    try:
        obj = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object string: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{name} must be a JSON object string")  # noqa: TRY004 (pydantic: ValueError -> 400)
    return obj
