"""A `/v1/responses` request as a chat request (docs/protocols.md §2.9, NeMo Gym `vllm_model` rules)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from rlserve.server.errors import bad_request
from rlserve.server.protocol import ChatCompletionRequest, ResponsesRequest

TOKEN_FIELDS = ("prompt_token_ids", "generation_token_ids", "generation_log_probs")
# Responses-only fields: everything else (sampling knobs, vLLM extras) passes through to chat
_RESPONSES_ONLY = {
    "input",
    "instructions",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_output_tokens",
    "metadata",
    "reasoning",
    "text",
    "truncation",
    "previous_response_id",
    "replace_developer_role_with_system",
    "store",
    "include",
    "background",
    "user",
    "prompt",
    "conversation",
    "top_logprobs",
}
_ASSISTANT_SIDE = ("reasoning", "function_call")


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    if body.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation in input",
            "previous_response_id",
        )
    text_format = body.text.format.type if body.text and body.text.format else None
    if text_format not in (None, "text"):
        raise bad_request(
            f'text.format {text_format!r} is not supported yet; omit it or send {{"type": "text"}}', "text"
        )
    tools = [_chat_tool(t, i) for i, t in enumerate(body.tools or [])]
    kwargs = dict(body.chat_template_kwargs or {})
    effort = (body.reasoning or {}).get("effort")
    if effort is not None:
        kwargs.setdefault("reasoning_effort", effort)
    data = {k: v for k, v in body.model_dump().items() if k not in _RESPONSES_ONLY}
    data.update(
        messages=to_messages(body.input, body.instructions, body.replace_developer_role_with_system),
        tools=tools or None,
        tool_choice=_tool_choice(body.tool_choice, tools),
        chat_template_kwargs=kwargs or None,
        max_tokens=body.max_output_tokens,
        max_completion_tokens=None,
        n=1,
        # token fields carry logprobs; prompt_token_ids is on the response, so token ids are always kept
        logprobs=body.return_token_ids,
        top_logprobs=0,
    )
    return ChatCompletionRequest.model_validate(data)


def _chat_tool(tool: dict[str, Any], i: int) -> dict[str, Any]:
    """Flat `{type, name, description, parameters, strict}` -> `{type: function, function: {...}}`."""
    if tool.get("type") != "function":
        raise bad_request(f"tools[{i}] has type {tool.get('type')!r}; only function tools are supported", f"tools.{i}")
    if isinstance(tool.get("function"), dict):  # already chat-shaped
        return tool
    if not isinstance(tool.get("name"), str):
        raise bad_request(f"tools[{i}] needs a name", f"tools.{i}")
    fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": fn}


def _tool_choice(choice: str | dict[str, Any], tools: list[dict[str, Any]]) -> str | dict[str, Any] | None:
    if not tools:  # dropped without tools, but "required" or a named tool cannot be met
        if choice == "required" or isinstance(choice, dict):
            raise bad_request(f"tool_choice {choice!r} needs tools; send tools or drop tool_choice", "tool_choice")
        return None
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise bad_request(
                'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}', "tool_choice"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


@dataclass
class _AssistantTurn:
    """Consecutive assistant-side items, merged into one assistant message."""

    texts: list[str] = field(default_factory=list)
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tokens: dict[str, Any] = field(default_factory=dict)

    def message(self) -> dict[str, Any]:
        m: dict[str, Any] = {"role": "assistant", "content": "".join(self.texts) or None, **self.tokens}
        if self.reasoning is not None:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m


def to_messages(
    input: str | list[dict[str, Any]], instructions: str | None, developer_as_system: bool = False
) -> list[dict[str, Any]]:
    if isinstance(input, str):
        input = [{"role": "user", "content": [{"type": "input_text", "text": input}]}]
    messages: list[dict[str, Any]] = []
    turn: _AssistantTurn | None = None
    for i, item in enumerate(input):
        if not isinstance(item, dict):
            raise bad_request(f"input[{i}] must be an object", f"input.{i}")
        kind = item.get("type") or ("message" if "role" in item else None)
        assistant_side = kind in _ASSISTANT_SIDE or (kind == "message" and item.get("role") == "assistant")
        if not assistant_side and turn is not None:
            messages.append(turn.message())
            turn = None
        if assistant_side:
            turn = turn or _AssistantTurn()
            _add_to_turn(turn, kind, item, i)
        elif kind == "message":
            messages.append(_input_message(item, i))
        elif kind == "function_call_output":
            messages.append(_tool_result(item, i))
        else:
            raise bad_request(
                f"input[{i}] has type {kind!r}; supported: message, reasoning, function_call, function_call_output",
                f"input.{i}",
            )
        tokens = _token_fields(item, i)
        if tokens and not assistant_side:
            raise bad_request(
                f"input[{i}] carries token fields, but only assistant-side items (assistant "
                "message, reasoning, function_call) can",
                f"input.{i}",
            )
        if tokens:
            turn.tokens = tokens  # type: ignore[union-attr]
    if turn is not None:
        messages.append(turn.message())
    if instructions is not None:
        lead = []
        while messages and messages[0]["role"] in ("system", "developer"):
            lead.append(_text(messages.pop(0)["content"]))
        messages.insert(0, {"role": "system", "content": "\n\n".join([instructions, *lead])})
    if developer_as_system:
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    return messages


def _add_to_turn(turn: _AssistantTurn, kind: str, item: dict[str, Any], i: int) -> None:
    if kind == "message":
        content = item.get("content")
        parts = [{"type": "output_text", "text": content}] if isinstance(content, str) else content or []
        for j, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") not in ("output_text", "input_text", "text"):
                raise bad_request(
                    f"input[{i}].content[{j}]: assistant messages take output_text parts", f"input.{i}.content"
                )
            turn.texts.append(part.get("text") or "")
    elif kind == "reasoning":
        texts = [
            p.get("text") for p in [*(item.get("summary") or []), *(item.get("content") or [])] if isinstance(p, dict)
        ]
        first = next((t for t in texts if t), None)
        if turn.reasoning is None and first is not None:  # history content carries no <think>
            turn.reasoning = first
    else:
        if not item.get("call_id"):
            raise bad_request(f"input[{i}] is a function_call without call_id", f"input.{i}.call_id")
        arguments = item.get("arguments", "")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        turn.tool_calls.append(
            {"id": item["call_id"], "type": "function", "function": {"name": item.get("name"), "arguments": arguments}}
        )


def _input_message(item: dict[str, Any], i: int) -> dict[str, Any]:
    role = item.get("role")
    if role not in ("user", "system", "developer"):
        raise bad_request(f"input[{i}] has role {role!r}; use user, system, developer or assistant", f"input.{i}.role")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    parts = []
    for j, part in enumerate(content or []):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "text"):
            parts.append({"type": "text", "text": part.get("text") or ""})
        elif kind == "input_image":
            parts.append(
                {
                    "type": "image_url",
                    "image_url": {"url": part.get("image_url"), "detail": part.get("detail") or "auto"},
                }
            )
        elif kind == "input_video":
            parts.append({"type": "video_url", "video_url": {"url": part.get("video_url")}})
        else:
            raise bad_request(
                f"input[{i}].content[{j}] has type {kind!r}; use input_text, input_image or input_video",
                f"input.{i}.content",
            )
    return {"role": role, "content": parts}


def _tool_result(item: dict[str, Any], i: int) -> dict[str, Any]:
    if not item.get("call_id"):
        raise bad_request(f"input[{i}] is a function_call_output without call_id", f"input.{i}.call_id")
    output = item.get("output")
    if isinstance(output, list):
        if not all(isinstance(p, dict) and p.get("type") == "input_text" for p in output):
            raise bad_request(f"input[{i}].output may hold only input_text parts", f"input.{i}.output")
        output = "".join(p.get("text") or "" for p in output)
    elif not isinstance(output, str):
        raise bad_request(f"input[{i}].output must be a string or a list of input_text parts", f"input.{i}.output")
    return {"role": "tool", "tool_call_id": item["call_id"], "content": output}


def _token_fields(item: dict[str, Any], i: int) -> dict[str, Any]:
    present = {k: item[k] for k in TOKEN_FIELDS if item.get(k) is not None}
    if present and len(present) < len(TOKEN_FIELDS):
        missing = ", ".join(k for k in TOKEN_FIELDS if k not in present)
        raise bad_request(
            f"input[{i}] carries only some token fields (missing {missing}); send all three as returned, or none",
            f"input.{i}",
        )
    return present


def _text(content: str | list[dict[str, Any]] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "\n".join(p.get("text") or "" for p in content)
