"""Messages -> prompt token ids through the model's HF chat template (docs/protocols.md §2.3 "Rendering").

The ids must equal HF `apply_chat_template(..., tokenize=True)` for the same inputs: NexRL and
verifiers rebuild prompts on the client and compare. An assistant message carrying its turn's exact
tokens (`prompt_token_ids` + `generation_token_ids`) replaces the rendering up to the end of that turn
(§2.3 token splice), so multi-turn prompts never re-tokenize what the model generated.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import jinja2

from rlserve.server.errors import bad_request
from rlserve.server.openai.template_limits import MAX_RENDERED_TOKENS, RenderLimitError, bounded_render
from rlserve.server.protocol import ChatMessage, ChatTemplateFields

# apply_chat_template's own arguments: a template kwarg of the same name would clash with them
_RESERVED = {
    "conversation",
    "messages",
    "tools",
    "documents",
    "chat_template",
    "add_generation_prompt",
    "continue_final_message",
    "tokenize",
    "padding",
    "truncation",
    "max_length",
    "return_tensors",
    "return_dict",
    "return_assistant_tokens_mask",
    "tokenizer_kwargs",
}
_MEDIA_PARTS = {"image_url", "video_url", "input_audio", "audio_url"}


def load_template(value: str | None) -> str | None:
    """config.model.chat_template: a file path or the template itself."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and path.is_file():
        return path.read_text()
    return value


def message_chars(fields: ChatTemplateFields) -> int:
    """How much text the messages hold (a lower bound on what the template renders)."""
    total = 0
    for m in fields.messages or []:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text or "") for p in m.content)
    return total


def render_chat(
    tokenizer, fields: ChatTemplateFields, default_template: str | None, trust_request_template: bool = False
) -> list[int]:
    """Runs in the server's tokenizer thread. A request's own chat_template only when the operator trusts
    them (vLLM's --trust-request-chat-template), and then bounded in time and size."""
    if fields.chat_template is not None and not trust_request_template:
        raise bad_request(
            "this server does not accept a chat_template in requests; drop it, or start the server "
            "with --server.trust_request_chat_template true",
            "chat_template",
        )
    if fields.add_generation_prompt and fields.continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message cannot both be true; "
            "set add_generation_prompt to false to continue the final message",
            "continue_final_message",
        )
    if not fields.messages:
        raise bad_request("messages must hold at least one message", "messages")
    messages = [_message(m, i) for i, m in enumerate(fields.messages)]
    ids = _apply(
        tokenizer, fields, default_template, messages, fields.add_generation_prompt, fields.continue_final_message
    )
    turn = _spliced_turn(fields.messages)
    if turn is None:
        return ids
    k, turn_ids = turn
    end = tokenizer.eos_token_id
    head = turn_ids[:-1] if turn_ids and turn_ids[-1] == end else turn_ids
    if k == len(messages) - 1 and fields.continue_final_message:
        return head  # the spliced turn is the one being continued
    # the template closes message k with its `closes`-th end-of-turn token: keep what follows it
    closes = _apply(tokenizer, fields, default_template, messages[: k + 1], False, False).count(end)
    ends = [i for i, t in enumerate(ids) if t == end]
    if closes == 0 or len(ends) < closes:
        raise bad_request(
            f"messages[{k}] carries token ids, but the chat template does not close that turn with "
            "the end-of-turn token, so they cannot be spliced; drop prompt_token_ids and "
            "generation_token_ids",
            f"messages.{k}",
        )
    return head + ids[ends[closes - 1] :]


def _apply(
    tokenizer,
    fields: ChatTemplateFields,
    default_template: str | None,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
) -> list[int]:
    kwargs = {k: v for k, v in (fields.chat_template_kwargs or {}).items() if k not in _RESERVED}
    bounded = bounded_render if fields.chat_template is not None else contextlib.nullcontext
    try:
        with bounded():
            ids = tokenizer.apply_chat_template(
                messages,
                tools=[t.model_dump(exclude_unset=True) for t in fields.tools] if fields.tools else None,
                chat_template=fields.chat_template or default_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=True,
                return_dict=False,
                **kwargs,
            )
    except RenderLimitError as e:
        raise bad_request(f"the request's chat_template {e}", "chat_template") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError, IndexError) as e:
        raise bad_request(f"the chat template could not render these messages: {e}", "messages") from None
    if isinstance(ids, dict):  # BatchEncoding from tokenizers that ignore return_dict
        ids = ids["input_ids"]
    if not ids:
        raise bad_request(
            "the chat template rendered nothing for these messages; check the messages and the template", "messages"
        )
    if fields.chat_template is not None and len(ids) > MAX_RENDERED_TOKENS:
        raise bad_request(
            f"the request's chat_template rendered {len(ids)} tokens, more than {MAX_RENDERED_TOKENS}", "chat_template"
        )
    return list(ids)


def _spliced_turn(messages: list[ChatMessage]) -> tuple[int, list[int]] | None:
    """The last assistant message carrying its exact tokens: (index, prompt + generation ids)."""
    found = None
    for i, m in enumerate(messages):
        fields = (m.prompt_token_ids, m.generation_token_ids, m.generation_log_probs)
        if all(f is None for f in fields) or m.role != "assistant":
            continue
        if m.prompt_token_ids is None or m.generation_token_ids is None:
            raise bad_request(
                f"messages[{i}] carries only some token fields: send prompt_token_ids and "
                "generation_token_ids (and generation_log_probs) together, or none",
                f"messages.{i}",
            )
        if m.generation_log_probs is not None and len(m.generation_log_probs) != len(m.generation_token_ids):
            raise bad_request(
                f"messages[{i}].generation_log_probs must have one entry per generation_token_ids entry",
                f"messages.{i}.generation_log_probs",
            )
        found = (i, [*m.prompt_token_ids, *m.generation_token_ids])
    return found


def _message(m: ChatMessage, i: int) -> dict[str, Any]:
    d = m.model_dump(exclude_none=True, exclude={"prompt_token_ids", "generation_token_ids", "generation_log_probs"})
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
            raise bad_request(
                f"messages[{i}].content[{j}] is {part.type!r}: this model takes text only", f"messages.{i}.content"
            )
        else:
            raise bad_request(
                f'messages[{i}].content[{j}] has unsupported type {part.type!r}; use {{"type": "text", "text": ...}}',
                f"messages.{i}.content",
            )
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
