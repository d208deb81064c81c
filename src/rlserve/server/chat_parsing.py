"""Where generated chat text becomes `message` fields: reasoning, content and tool calls.

Only the raw form exists so far (all text is `content`); reasoning and tool-call parsers
(`reasoning.py`, `tool_parsers.py`) plug in here by returning another parser from `output_parser`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlserve.server.protocol import ChatCompletionRequest


@dataclass
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class RawParser:
    """No parser configured: the whole text is content."""

    def parse(self, text: str) -> ParsedMessage:
        return ParsedMessage(content=text)

    def streamer(self) -> RawStreamer:
        return RawStreamer()


class RawStreamer:
    """Per-request streaming counterpart of `parse`: text deltas in, delta-message fields out."""

    has_tool_calls = False  # a tool-call streamer sets it so the last chunk says finish_reason "tool_calls"

    def feed(self, delta_text: str) -> dict[str, Any]:
        return {"content": delta_text} if delta_text else {}

    def finish(self) -> dict[str, Any]:
        return {}


def output_parser(body: ChatCompletionRequest) -> RawParser:
    return RawParser()
