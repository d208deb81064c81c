"""The server-sent events of a streamed `/v1/messages` answer, as vLLM 0.32 sends them: message_start,
then per content block content_block_start -> content_block_delta... -> content_block_stop, then
message_delta (stop_reason, usage) and message_stop. Blocks come in the order the text arrives; text that
follows a tool_use block is held and sent as its own text block when that block closes."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any


class MessageEvents:
    def __init__(self, message_id: str, model: str) -> None:
        self.id, self.model = message_id, model
        self.index = -1  # the open block's index (or the last closed one's)
        self.open: str | None = None  # the open block's type
        self.signature: str | None = None
        self.tool_id: str | None = None
        self.tool_ids: dict[int, str] = {}  # the tool-call delta index -> its block's id
        self.held: list[str] = []
        self.tool_used = False

    @staticmethod
    def event(kind: str, **fields: Any) -> str:
        data = json.dumps({"type": kind, **fields}, ensure_ascii=False, separators=(",", ":"))
        return f"event: {kind}\ndata: {data}\n\n"

    def start(self, input_tokens: int) -> str:
        message = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        }
        return self.event("message_start", message=message)

    def apply(self, delta: dict[str, Any]) -> Iterator[str]:
        if delta.get("reasoning"):
            if self.open != "thinking":
                yield from self._flush()
                yield from self._open({"type": "thinking", "thinking": ""})
            yield self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]})
        if delta.get("content"):
            if self.open == "tool_use":
                self.held.append(delta["content"])
            else:
                if self.open != "text":
                    yield from self._flush()
                    yield from self._open({"type": "text", "text": ""})
                yield self._delta({"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls", ()):
            fn = call.get("function") or {}
            if call.get("id") is not None:
                self.tool_ids[call["index"]] = call["id"]
                if self.tool_id != call["id"]:
                    yield from self._flush()
                    self.tool_used = True
                    yield from self._open({"type": "tool_use", "id": call["id"], "name": fn.get("name"), "input": {}})
            if fn.get("arguments") and self.tool_id == self.tool_ids.get(call["index"]):
                yield self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]})

    def finish(self, stop_reason: str | None, stop_sequence: str | None, usage: dict[str, int]) -> Iterator[str]:
        yield from self._flush()
        yield self.event(
            "message_delta", delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence}, usage=usage
        )
        yield self.event("message_stop")

    def _open(self, block: dict[str, Any]) -> Iterator[str]:
        self.index += 1
        self.open = block["type"]
        self.signature = uuid.uuid4().hex if block["type"] == "thinking" else None
        self.tool_id = block.get("id")
        yield self.event("content_block_start", index=self.index, content_block=block)

    def _delta(self, delta: dict[str, Any]) -> str:
        return self.event("content_block_delta", index=self.index, delta=delta)

    def _close(self) -> Iterator[str]:
        if self.open is None:
            return
        if self.signature is not None:
            yield self._delta({"type": "signature_delta", "signature": self.signature})
        yield self.event("content_block_stop", index=self.index)
        self.open = self.signature = self.tool_id = None

    def _flush(self) -> Iterator[str]:
        """Close the open block; text held behind a tool_use block becomes a block of its own."""
        held, self.held = "".join(self.held), []
        yield from self._close()
        if held:
            yield from self._open({"type": "text", "text": ""})
            yield self._delta({"type": "text_delta", "text": held})
            yield from self._close()
