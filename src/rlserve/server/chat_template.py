"""Messages -> prompt token ids through the model's HF chat template (wire-protocols §2.3 "Rendering").

The ids must equal HF `apply_chat_template(..., tokenize=True)` for the same inputs: NexRL and
verifiers rebuild prompts on the client and compare.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from rlserve.server.errors import bad_request
from rlserve.server.protocol import ChatMessage, ChatTemplateFields

# apply_chat_template's own arguments: a template kwarg of the same name would clash with them
_RESERVED = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
             "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
_MEDIA_PARTS = {"image_url", "video_url", "input_audio", "audio_url"}


def load_template(value: str | None) -> str | None:
    """config.model.chat_template: a file path or the template itself."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text()
    return value


def render_chat(tokenizer, fields: ChatTemplateFields, default_template: str | None) -> list[int]:
    if fields.add_generation_prompt and fields.continue_final_message:
        raise bad_request("add_generation_prompt and continue_final_message cannot both be true; "
                          "set add_generation_prompt to false to continue the final message", "continue_final_message")
    if not fields.messages:
        raise bad_request("messages must hold at least one message", "messages")
    messages = [_message(m, i) for i, m in enumerate(fields.messages)]
    kwargs = {k: v for k, v in (fields.chat_template_kwargs or {}).items() if k not in _RESERVED}
    try:
        ids = tokenizer.apply_chat_template(
            messages,
            tools=fields.tools,
            chat_template=fields.chat_template or default_template,
            add_generation_prompt=fields.add_generation_prompt,
            continue_final_message=fields.continue_final_message,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    if isinstance(ids, dict):  # BatchEncoding from tokenizers that ignore return_dict
        ids = ids["input_ids"]
    return list(ids)


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True)
    d["content"] = _content(m, i)
    reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
    d.pop("reasoning", None)
    if reasoning is not None:
        d["reasoning_content"] = reasoning
    if m.tool_calls is not None:
        d["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
    return d


def _content(m: ChatMessage, i: int) -> str | None:
    """Text parts are joined with newlines (vLLM's "string" content format)."""
    if m.content is None or isinstance(m.content, str):
        return m.content
    texts = []
    for j, part in enumerate(m.content):
        if part.type in ("text", "input_text", "output_text") and part.text is not None:
            texts.append(part.text)
        elif part.type in _MEDIA_PARTS:
            raise bad_request(f"messages[{i}].content[{j}] is {part.type!r}: this model takes text only",
                              f"messages.{i}.content")
        else:
            raise bad_request(f"messages[{i}].content[{j}] has unsupported type {part.type!r}; "
                              "use {\"type\": \"text\", \"text\": ...}", f"messages.{i}.content")
    return "\n".join(texts)


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """Templates index `arguments` as a mapping; clients send the OpenAI JSON string."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        args = json.loads(fn["arguments"])
    except json.JSONDecodeError:
        return call
    return {**call, "function": {**fn, "arguments": args}}
