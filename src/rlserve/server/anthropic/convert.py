"""Anthropic Messages requests as chat requests, and chat outcomes as Anthropic answers.

Follows vLLM 0.32's mapping (entrypoints/anthropic/serving.py): `system` becomes a leading system message,
`tool_use` blocks become assistant tool calls, a user's `tool_result` blocks become tool messages,
`thinking` blocks become the assistant's reasoning; `tool_choice` any -> required, tool -> named.
What rlserve cannot honour (images, a thinking budget, tool additions) is a 400 that says so.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from rlserve.server.errors import APIError, bad_request
from rlserve.server.protocol import ChatCompletionRequest


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(_Lenient):
    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    thinking: str | None = None


class Message(_Lenient):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(_Lenient):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputConfig(_Lenient):
    effort: str | None = None
    format: dict[str, Any] | None = None


class MessagesRequest(_Lenient):
    model: str = Field(min_length=1)
    messages: list[Message]
    max_tokens: int
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v: int) -> int:
        if v <= 0:
            raise ValueError("max_tokens must be positive")
        return v


class CountTokensRequest(MessagesRequest):
    max_tokens: int = 1  # count_tokens takes none


# vLLM-only request fields that ride along to the chat request unchanged
_PASSTHROUGH = ("cache_salt", "kv_transfer_params", "vllm_xargs", "request_id", "priority")


def to_chat_request(req: MessagesRequest) -> ChatCompletionRequest:
    messages: list[dict[str, Any]] = []
    system = _system_text(req.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, msg in enumerate(req.messages):
        messages += _convert_message(msg, f"messages.{i}")
    data: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "stream": bool(req.stream),
    }
    data.update({k: v for k, v in (req.model_extra or {}).items() if k in _PASSTHROUGH})
    kwargs = dict(req.chat_template_kwargs or {})
    _thinking(req, kwargs)
    if req.output_config is not None:
        if req.output_config.effort is not None:
            kwargs["reasoning_effort"] = req.output_config.effort
        schema = (req.output_config.format or {}).get("schema")
        if schema is not None:
            data["response_format"] = {"type": "json_schema", "json_schema": {"name": "json_schema", "schema": schema}}
    if kwargs:
        data["chat_template_kwargs"] = kwargs
    if req.tools is not None:
        data["tools"] = [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": _schema(t.input_schema)},
            }
            for t in req.tools
        ]
    data["tool_choice"] = _tool_choice(req.tool_choice, has_tools=req.tools is not None)
    return ChatCompletionRequest.model_validate(data)


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if system is None or isinstance(system, str):
        return system or ""
    for i, block in enumerate(system):
        if block.type != "text":
            raise bad_request(f"system.{i}: only text blocks are allowed in system, got {block.type!r}", "system")
    # Claude Code's per-request billing header would defeat the prefix cache (vLLM drops it too)
    return "".join(b.text or "" for b in system if not (b.text or "").startswith("x-anthropic-billing-header"))


def _convert_message(msg: Message, where: str) -> list[dict[str, Any]]:
    if isinstance(msg.content, str):
        return [{"role": msg.role, "content": msg.content}]
    if msg.role == "system":
        return [{"role": "system", "content": _system_text(msg.content)}]
    before: list[dict[str, Any]] = []  # a user's tool results come before the rest of its turn
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for j, block in enumerate(msg.content):
        kind = block.type
        if kind == "text":
            texts.append(block.text or "")
        elif kind == "thinking":
            reasoning.append(block.thinking or "")
        elif kind == "redacted_thinking":
            continue  # opaque; clients echo it back with the assistant turn
        elif kind == "tool_use":
            arguments = json.dumps(block.input or {})
            calls.append(
                {
                    "id": block.id or f"call_{j}",
                    "type": "function",
                    "function": {"name": block.name or "", "arguments": arguments},
                }
            )
        elif kind == "tool_result":
            if msg.role == "user":
                before.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id or "",
                        "content": _result_text(block, f"{where}.content.{j}"),
                    }
                )
            else:
                texts.append(f"Tool result: {_result_text(block, f'{where}.content.{j}')}")
        else:
            raise bad_request(
                f"{where}.content.{j}: content blocks of type {kind!r} are not supported by this server "
                "(text, thinking, redacted_thinking, tool_use and tool_result are)",
                f"{where}.content",
            )
    out: dict[str, Any] = {"role": msg.role}
    if texts:
        out["content"] = "".join(texts)
    if calls:
        out["tool_calls"] = calls
    if reasoning:
        out["reasoning"] = "".join(reasoning)
    keep = texts or calls or reasoning or (msg.role == "assistant" and not before)
    return before + ([out] if keep else [])


def _result_text(block: ContentBlock, where: str) -> str:
    if block.content is None or isinstance(block.content, str):
        return block.content or ""
    parts = []
    for item in block.content:
        if item.get("type") != "text":
            raise bad_request(
                f"{where}: tool_result content of type {item.get('type')!r} is not supported (text is)", where
            )
        parts.append(str(item.get("text", "")))
    return "\n".join(parts)


def _schema(schema: dict[str, Any]) -> dict[str, Any]:
    return schema if "type" in schema else {**schema, "type": "object"}


def _thinking(req: MessagesRequest, kwargs: dict[str, Any]) -> None:
    thinking = req.thinking
    if thinking is None or thinking.type == "adaptive":
        return
    if thinking.type == "disabled":
        kwargs.setdefault("enable_thinking", False)
        return
    budget = thinking.budget_tokens
    if budget is None or budget < 1024:
        raise bad_request("thinking.budget_tokens must be an integer >= 1024", "thinking.budget_tokens")
    if budget >= req.max_tokens:
        raise bad_request("thinking.budget_tokens must be less than max_tokens", "thinking.budget_tokens")
    # rlserve cannot stop the reasoning at a token budget: say so rather than run past it
    raise bad_request(
        'thinking {"type": "enabled", "budget_tokens": ...} is not supported: this server does not enforce a '
        'reasoning budget; send thinking {"type": "adaptive"} (reasoning bounded by max_tokens) or omit it',
        "thinking",
    )


def _tool_choice(choice: ToolChoice | None, has_tools: bool) -> Any:
    if choice is None:
        return "auto" if has_tools else None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice.name is required when type is 'tool'", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def stop_reason(finish_reason: str | None, stop: int | str | None, tool_used: bool) -> tuple[str | None, str | None]:
    """(stop_reason, stop_sequence) from a chat choice's finish: max_tokens wins, then tool_use,
    then a matched stop string."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_used:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int) -> dict[str, int]:
    return {"input_tokens": prompt_tokens, "output_tokens": output_tokens}


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "invalid_request_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def error_body(err: APIError) -> dict[str, Any]:
    """Anthropic's error shape: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(err.status, "api_error"), "message": err.message}}
