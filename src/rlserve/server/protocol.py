"""Request bodies. Unknown fields are kept and ignored (never 4xx); sampling ranges are checked by
SamplingParams and documented here (`bound`), so /openapi.json tells what a route accepts."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

ROLES = ("system", "developer", "user", "assistant", "tool", "function")


def bound(default: Any = None, **schema: Any) -> Any:
    """A field whose range SamplingParams checks (with a message naming it); the schema documents it."""
    return Field(default, json_schema_extra=schema)


class Body(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _null_means_default(cls, value: Any, info) -> Any:
        # routers and SDKs send explicit nulls for fields they did not set
        field = cls.model_fields[info.field_name]
        if value is None and not field.is_required():
            return field.get_default(call_default_factory=True)
        if isinstance(value, bool) and not _takes_bool(field.annotation):
            raise ValueError(f"must be a number, not {str(value).lower()}")  # pydantic would read true as 1
        return value


def _takes_bool(annotation: Any) -> bool:
    if annotation in (int, float):
        return False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return any(_takes_bool(a) for a in typing.get_args(annotation) if a is not type(None))
    return True


class PolicyWindow(Body):
    """rlserve extension: 409 when the served policy is outside the caller's window (§2.15)."""

    min_policy_version: int | None = None
    max_policy_version: int | None = None
    max_staleness: int | None = Field(None, ge=0)
    policy_version: int | None = None
    policy_wait_s: float | None = Field(None, ge=0)  # server/staleness.py


POLICY_FIELDS = frozenset(PolicyWindow.model_fields)


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationFields(PolicyWindow):
    """Fields shared by /v1/completions and /v1/chat/completions (docs/protocols.md §2.1)."""

    model: str | None = None
    n: int = bound(1, minimum=1)
    temperature: float = bound(1.0, minimum=0)
    top_p: float = bound(1.0, exclusiveMinimum=0, maximum=1)
    top_k: int = bound(-1, minimum=-1)
    min_p: float = bound(0.0, minimum=0, maximum=1)
    seed: int | None = None
    max_tokens: int | None = bound(None, minimum=1)
    min_tokens: int = bound(0, minimum=0)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    no_stop_trim: bool = False
    prompt_logprobs: int | None = bound(None, minimum=-1)
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    request_id: str | None = None
    rid: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] | None = None  # left (the default) keeps the last tokens
    use_beam_search: bool = False  # refused: no beam search (server/sampling.py)
    logprob_token_ids: list[int] | None = None  # refused: not supported (server/sampling.py)
    presence_penalty: float = bound(0.0, minimum=-2, maximum=2)
    frequency_penalty: float = bound(0.0, minimum=-2, maximum=2)
    repetition_penalty: float = bound(1.0, exclusiveMinimum=0)
    logit_bias: dict[str, float] | None = None  # clamped to [-100, 100] (vLLM)
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(GenerationFields):
    # checked in openai/completions.py for a clearer message than a union's
    prompt: Any = Field(
        None,
        json_schema_extra={
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}},
                {"type": "array", "items": {"type": "integer"}},
                {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
            ]
        },
    )
    echo: bool = False
    logprobs: bool | int | None = None
    add_special_tokens: bool = True


class ContentPart(Body):
    type: str
    text: str | None = None


class ChatMessage(Body):
    role: str = Field(min_length=1)  # ROLES, or a custom role the chat template renders as it is (vLLM)
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


class FunctionDef(Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class ChatTemplateFields(Body):
    """How a conversation becomes a prompt; shared by chat and /tokenize."""

    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class ChatCompletionRequest(ChatTemplateFields, GenerationFields):
    messages: list[ChatMessage]
    logprobs: bool = False
    top_logprobs: int | None = bound(None, minimum=0)
    max_completion_tokens: int | None = bound(None, minimum=1)
    echo: bool = False  # the reply starts with the last message's content when that message has the reply's role
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


class TextFormat(Body):
    type: str = "text"


class ResponseText(Body):
    format: TextFormat | None = None


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
    text: ResponseText | None = None
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
