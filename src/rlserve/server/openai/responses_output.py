"""Chat results as Responses output (docs/protocols.md §2.9 "Chat result -> Response")."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from rlserve.engine.outputs import RequestOutput
from rlserve.server.chat_parsing import ParsedMessage
from rlserve.server.openai.chat import Ctx
from rlserve.server.protocol import ResponsesRequest
from rlserve.server.state import clamp, version_fields


@dataclass
class Turn:
    """What one Responses request needs besides the chat context."""

    ctx: Ctx
    body: ResponsesRequest
    id: str
    created: int

    def envelope(self, status: str = "in_progress") -> dict[str, Any]:
        body = self.body
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "model": self.ctx.model,
            "status": status,
            "error": None,
            "incomplete_details": None,
            "instructions": body.instructions,
            "metadata": body.metadata or {},
            "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": body.temperature,
            "tool_choice": body.tool_choice,
            "tools": body.tools or [],
            "top_p": body.top_p,
            "reasoning": body.reasoning,
            "text": _text(body),
            "truncation": body.truncation or "disabled",
            "max_output_tokens": body.max_output_tokens,
            "output": [],
            "usage": None,
        }

    def finished(self, items: list[dict[str, Any]], out: RequestOutput | None) -> dict[str, Any]:
        """The final response around `items`; `out` None means the prompt did not fit (no generation)."""
        o = out.outputs[0] if out is not None else None
        incomplete = o is None or o.finish_reason == "length"
        response = self.envelope("incomplete" if incomplete else "completed")
        response["incomplete_details"] = {"reason": "max_output_tokens"} if incomplete else None
        response["output"] = items
        prompt_len = len(out.prompt_token_ids) if out is not None else len(self.ctx.prompt)
        cached = out.num_cached_tokens if out is not None else 0
        output_tokens = len(o.token_ids) if o is not None else 0
        reasoning = self.ctx.parser.reasoning_tokens(o.token_ids) if o is not None else 0
        response["usage"] = {
            "input_tokens": prompt_len,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning},
            "total_tokens": prompt_len + output_tokens,
        }
        if o is not None:
            response.update(version_fields(self.ctx.state, o))
        return response

    def token_fields(self, out: RequestOutput | None) -> dict[str, Any]:
        if out is None or not self.body.return_token_ids:
            return {}
        o = out.outputs[0]
        return {
            "prompt_token_ids": out.prompt_token_ids,
            "generation_token_ids": o.token_ids,
            "generation_log_probs": [clamp(lp) for lp in o.logprobs or []],
        }


def output_items(parsed: ParsedMessage) -> list[dict[str, Any]]:
    items = []
    if parsed.reasoning:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning))
    if parsed.content or not (parsed.reasoning or parsed.tool_calls):  # output is never empty
        items.append(message_item(new_id("msg"), parsed.content or ""))
    for call in parsed.tool_calls:
        items.append(function_call_item(call["id"], call["function"]["name"], call["function"]["arguments"]))
    return items


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    summary = [{"type": "summary_text", "text": text}] if text else []
    return {"type": "reasoning", "id": item_id, "summary": summary, "status": status}


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(item_id: str, text: str | None, status: str = "completed") -> dict[str, Any]:
    content = [] if text is None else [output_text(text)]
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": content}


def function_call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": call_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _text(body) -> dict[str, Any]:
    if body.text is None or body.text.format is None:
        return {"format": {"type": "text"}}
    return body.text.model_dump()
