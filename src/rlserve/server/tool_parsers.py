"""Tool-call parsers for model text (wire-protocols §2.10): hermes, llama3_json, mistral.

A parser is stateless: `extract(text)` parses a finished output, `streamer()` makes the
per-request streaming state. Streaming sends what is certainly content at once; text that might
be a tool call is held back until it is decided (for hermes and llama3_json that is the end of
generation, since one bad call turns the whole text back into content).
"""

from __future__ import annotations

import json
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)


class ToolStreamer(Protocol):
    def feed(self, delta_text: str) -> StreamDelta: ...
    def finish(self) -> StreamDelta: ...


def _openai_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def _mistral_id() -> str:
    # Mistral templates reject any other id shape, on history messages too.
    return "".join(random.choices(string.ascii_letters + string.digits, k=9))


def _arguments_json(value: Any) -> str:
    # A string is already the serialised arguments; encoding it again would nest it.
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _load_call(obj: Any, arg_keys: tuple[str, ...], new_id: Callable[[], str] = _openai_id) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    key = next((k for k in arg_keys if k in obj), None)
    if key is None:
        return None
    return ToolCall(new_id(), obj["name"], _arguments_json(obj[key]))


def _no_calls(content: str) -> ExtractedToolCalls:
    return ExtractedToolCalls(False, [], content or None)


def _held_tag_len(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that could still grow into `tag`."""
    i = text.find(tag[0], max(0, len(text) - len(tag) + 1))
    while i >= 0:
        if tag.startswith(text[i:]):
            return len(text) - i
        i = text.find(tag[0], i + 1)
    return 0


def _opening_delta(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "index": index,
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": ""},
    }


def _arguments_delta(index: int, arguments: str) -> dict[str, Any]:
    return {"index": index, "function": {"arguments": arguments}}


def _call_deltas(calls: list[ToolCall]) -> list[dict[str, Any]]:
    deltas = []
    for i, call in enumerate(calls):
        deltas.append(_opening_delta(i, call.id, call.name))
        if call.arguments:
            deltas.append(_arguments_delta(i, call.arguments))
    return deltas


class _DeferredStreamer:
    """Streams the text that is content whatever follows; the rest waits for finish()."""

    def __init__(self, parser: _DeferredParser) -> None:
        self._parser = parser
        self._pieces: list[str] = []
        self._sent = 0  # characters sent as content
        self._tail = ""  # text after them, while nothing is held
        self._holding = False  # a call may have started: keep everything for finish()

    def feed(self, delta_text: str) -> StreamDelta:
        self._pieces.append(delta_text)
        if self._holding:
            return StreamDelta()
        self._tail += delta_text
        n, self._holding = self._parser.scan(self._tail, at_start=self._sent == 0)
        out, self._tail = self._tail[:n], self._tail[n:]
        self._sent += n
        return StreamDelta(out)

    def finish(self) -> StreamDelta:
        result = self._parser.stream_result("".join(self._pieces))
        return StreamDelta((result.content or "")[self._sent :], _call_deltas(result.tool_calls))


class _DeferredParser:
    def extract(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def scan(self, tail: str, at_start: bool) -> tuple[int, bool]:
        """For the unsent `tail`: how many characters are content whatever follows, and whether
        the rest must be held until finish()."""
        raise NotImplementedError

    def stream_result(self, text: str) -> ExtractedToolCalls:
        return self.extract(text)

    def streamer(self) -> ToolStreamer:
        return _DeferredStreamer(self)


class HermesParser(_DeferredParser):
    """`<tool_call>{"name": …, "arguments": …}</tool_call>`, repeatable; all or nothing."""

    OPEN = "<tool_call>"
    SPAN = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)

    def extract(self, text: str) -> ExtractedToolCalls:
        first = text.find(self.OPEN)
        if first < 0:
            return _no_calls(text)
        calls = []
        for m in self.SPAN.finditer(text):
            try:
                obj = json.loads(m.group(1) if m.group(1) is not None else m.group(2))
            except json.JSONDecodeError:
                return _no_calls(text)
            call = _load_call(obj, ("arguments",))
            if call is None:
                return _no_calls(text)
            calls.append(call)
        return ExtractedToolCalls(True, calls, text[:first] or None)

    def scan(self, tail: str, at_start: bool) -> tuple[int, bool]:
        first = tail.find(self.OPEN)
        if first >= 0:
            return first, True
        return len(tail) - _held_tag_len(tail, self.OPEN), False


class Llama3JsonParser(_DeferredParser):
    """Every top-level JSON object `{"name": …, "arguments"|"parameters": …}`, optionally after
    `<|python_tag|>` and `;`-separated; all or nothing, prose around them is dropped."""

    BOT = "<|python_tag|>"
    _decoder = json.JSONDecoder()

    def extract(self, text: str) -> ExtractedToolCalls:
        calls: list[ToolCall] = []
        end = 0
        for m in re.finditer(r"\{", text):
            if m.start() < end:
                continue  # a brace inside an object already decoded
            try:
                obj, end = self._decoder.raw_decode(text, m.start())
            except json.JSONDecodeError:
                return _no_calls(text)
            call = _load_call(obj, ("arguments", "parameters"))
            if call is None:
                return _no_calls(text)
            calls.append(call)
        if not calls:
            return _no_calls(text)
        return ExtractedToolCalls(True, calls, None)

    def _is_call_text(self, text: str) -> bool:
        return text.startswith((self.BOT, "{"))

    def scan(self, tail: str, at_start: bool) -> tuple[int, bool]:
        if not at_start:
            return len(tail), False
        if self._is_call_text(tail):
            return 0, True
        return (0 if self.BOT.startswith(tail) else len(tail)), False

    def stream_result(self, text: str) -> ExtractedToolCalls:
        # Streaming looks for calls only at the very start (vLLM parity, §2.10).
        return self.extract(text) if self._is_call_text(text) else _no_calls(text)


class MistralParser:
    """`content[TOOL_CALLS] [{…}, …]` (tokenizer < v11) or `content[TOOL_CALLS]f{…}[TOOL_CALLS]g{…}`
    (v11+), told apart by the text after the first marker."""

    MARKER = "[TOOL_CALLS]"

    @staticmethod
    def is_pre_v11(after_marker: str) -> bool | None:
        """None until the first non-space character after the marker is known."""
        s = after_marker.lstrip()
        return s[0] in "[{" if s else None

    def extract(self, text: str) -> ExtractedToolCalls:
        parts = text.split(self.MARKER)
        if len(parts) == 1:
            return _no_calls(text)
        if self.is_pre_v11(parts[1]):
            return self._extract_pre_v11(parts)
        calls = []
        for segment in parts[1:]:
            brace = segment.find("{")
            if brace >= 0:  # arguments stay verbatim, even when they are not valid JSON
                name = segment[:brace].replace("[ARGS]", "")
                calls.append(ToolCall(_mistral_id(), name, segment[brace:]))
        return ExtractedToolCalls(bool(calls), calls, parts[0] or None)

    def _extract_pre_v11(self, parts: list[str]) -> ExtractedToolCalls:
        after = self.MARKER.join(parts[1:]).strip()
        if len(parts) > 2:
            return _no_calls(after)
        try:
            value, _ = json.JSONDecoder().raw_decode(after)  # trailing junk is ignored
        except json.JSONDecodeError:
            return _no_calls(after)
        calls = []
        for obj in value if isinstance(value, list) else [value]:
            if isinstance(obj, dict) and "arguments" not in obj:
                obj = {**obj, "arguments": {}}
            call = _load_call(obj, ("arguments",), new_id=_mistral_id)
            if call is None:
                return _no_calls(after)
            calls.append(call)
        return ExtractedToolCalls(bool(calls), calls, parts[0] or None)

    def streamer(self) -> ToolStreamer:
        return _MistralStreamer(self)


class _MistralStreamer:
    """v11 calls stream as they come (the name at the first `{`, then raw argument text);
    pre-v11 JSON is held back and parsed at finish()."""

    def __init__(self, parser: MistralParser) -> None:
        self._parser = parser
        self._pieces: list[str] = []  # the whole text, for the pre-v11 parse
        self._tail = ""  # text not handled yet
        self._after_marker = False
        self._pre_v11: bool | None = None
        self._calls = 0
        self._in_arguments = False

    def feed(self, delta_text: str) -> StreamDelta:
        self._pieces.append(delta_text)
        if self._pre_v11:
            return StreamDelta()
        self._tail += delta_text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._finish_pre_v11() if self._pre_v11 else self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        marker = MistralParser.MARKER
        out = StreamDelta()
        if not self._after_marker:
            m = self._tail.find(marker)
            if m < 0:
                n = len(self._tail) - (0 if final else _held_tag_len(self._tail, marker))
                out.content, self._tail = self._tail[:n], self._tail[n:]
                return out
            out.content, self._tail = self._tail[:m], self._tail[m + len(marker) :]
            self._after_marker = True
        if self._pre_v11 is None:
            self._pre_v11 = MistralParser.is_pre_v11(self._tail)
        if self._pre_v11 is False:
            out.tool_calls = self._advance_v11(final)
        return out

    def _finish_pre_v11(self) -> StreamDelta:
        text = "".join(self._pieces)
        result = self._parser.extract(text)
        content, sent = result.content or "", text[: text.find(MistralParser.MARKER)]
        # On failure non-streaming drops the text before the marker; here it was already sent.
        rest = content[len(sent) :] if content.startswith(sent) else content
        return StreamDelta(rest, _call_deltas(result.tool_calls))

    def _advance_v11(self, final: bool) -> list[dict[str, Any]]:
        marker = MistralParser.MARKER
        deltas = []
        while True:
            nxt = self._tail.find(marker)
            if not self._in_arguments:
                brace = self._tail.find("{")
                if brace >= 0 and (nxt < 0 or brace < nxt):
                    name = self._tail[:brace].replace("[ARGS]", "")
                    deltas.append(_opening_delta(self._calls, _mistral_id(), name))
                    self._calls += 1
                    self._in_arguments = True
                    self._tail = self._tail[brace:]
                elif nxt >= 0:  # a segment without `{` is skipped
                    self._tail = self._tail[nxt + len(marker) :]
                else:
                    return deltas
                continue
            if nxt >= 0:
                arguments, self._tail = self._tail[:nxt], self._tail[nxt + len(marker) :]
                self._in_arguments = False
            else:
                n = len(self._tail) - (0 if final else _held_tag_len(self._tail, marker))
                arguments, self._tail = self._tail[:n], self._tail[n:]
            if arguments:
                deltas.append(_arguments_delta(self._calls - 1, arguments))
            if nxt < 0:
                return deltas


_PARSERS: dict[str, type] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "llama4_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_tool_parser(name: str) -> HermesParser | Llama3JsonParser | MistralParser:
    if name not in _PARSERS:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(_PARSERS)}")
    return _PARSERS[name]()
