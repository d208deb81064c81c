"""What every tool-call format shares: the parsed call, the RL error flag, argument checks and the streamer.

A format only says where calls are in the text (`CallFormat.spans`) and how one call's text becomes a
name and arguments (`CallFormat.read_call`). Everything else is common:
- the content is the text before the first call (formats may trim it), as in vLLM;
- a call that cannot be used (bad JSON, unknown tool, unclosed, arguments against the tool's schema)
  is not returned as a call: its raw text is appended to the content and a `CallError` names what was
  wrong, so a reward function can penalise it and nothing vanishes;
- streaming sends content as soon as it cannot become part of a call, and each call when it closes:
  an opening delta (index, id, type, name) then its arguments, vLLM's delta shape.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any

import jsonschema

# Machine-readable kinds of CallError.kind (docs/parsers.md).
INVALID_JSON, UNKNOWN_TOOL, UNCLOSED_CALL, SCHEMA_MISMATCH, INVALID_SYNTAX = (
    "invalid_json",
    "unknown_tool",
    "unclosed_call",
    "schema_mismatch",
    "invalid_syntax",
)


@dataclass(slots=True)
class ToolCall:
    id: str
    name: str
    arguments: str


@dataclass(slots=True)
class CallError:
    kind: str
    message: str
    text: str
    name: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"type": self.kind, "name": self.name, "message": self.message, "text": self.text}


@dataclass(slots=True)
class ExtractedToolCalls:
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None
    errors: list[CallError] = field(default_factory=list)


@dataclass(slots=True)
class StreamDelta:
    content: str = ""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)


@dataclass(slots=True)
class Span:
    """One call's text: `text[start:end]`, `body` the part `read_call` reads; `closed` False when cut off."""

    start: int
    end: int
    body: str
    closed: bool = True


class BadCall(Exception):
    def __init__(self, kind: str, message: str, name: str | None = None):
        super().__init__(message)
        self.kind, self.name = kind, name


def new_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def mistral_call_id() -> str:
    """Mistral's chat templates refuse any tool call id but 9 letters or digits (vLLM makes the same)."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def arguments_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def load_json(text: str, what: str = "arguments") -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise BadCall(INVALID_JSON, f"{what} are not valid JSON: {e}") from None


def held_suffix_len(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still grow into one of `markers`."""
    longest = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), longest, -1):
            if marker.startswith(text[-n:]):
                longest = n
                break
    return longest


def opening_delta(index: int, call: ToolCall) -> dict[str, Any]:
    return {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}


def call_deltas(first_index: int, calls: list[ToolCall]) -> list[dict[str, Any]]:
    deltas = []
    for i, call in enumerate(calls, first_index):
        deltas.append(opening_delta(i, call))
        if call.arguments:
            deltas.append({"index": i, "function": {"arguments": call.arguments}})
    return deltas


class Tools:
    """The request's tools by name, for the unknown-tool and schema checks (none sent: nothing checked)."""

    def __init__(self, tools: list[dict[str, Any]] | None):
        self.schemas: dict[str, dict[str, Any]] = {}
        for tool in tools or []:
            fn = tool.get("function") or {}
            if isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters") or {}

    def param_type(self, tool: str, param: str) -> Any:
        return ((self.schemas.get(tool) or {}).get("properties") or {}).get(param, {}).get("type")

    def check(self, name: str, arguments: str) -> None:
        if not self.schemas:
            return
        if name not in self.schemas:
            raise BadCall(UNKNOWN_TOOL, f"no tool named {name!r}; tools: {sorted(self.schemas)}", name)
        args = load_json(arguments)
        if not isinstance(args, dict):
            raise BadCall(SCHEMA_MISMATCH, "arguments are not a JSON object", name)
        try:
            jsonschema.validate(args, self.schemas[name])
        except jsonschema.ValidationError as e:
            raise BadCall(
                SCHEMA_MISMATCH, f"arguments do not match the schema of {name!r}: {e.message}", name
            ) from None
        except jsonschema.SchemaError:
            return  # the tool's own schema is broken: nothing to hold the call against


class CallFormat:
    """One tool-call text format. Subclasses set START (the markers that open the call region) and
    implement `spans` and `read_call`; `trim_content` says how vLLM trims the text before the calls."""

    START: tuple[str, ...] = ()
    trim_content = False
    # True: calls are read only when the region is complete (JSON lists); the region is one span.
    whole_region = False

    def __init__(self, tools: list[dict[str, Any]] | None = None):
        self.tools = Tools(tools)

    def new_id(self) -> str:
        return new_call_id()

    def region_start(self, text: str) -> int:
        """Index where the calls begin, or -1."""
        found = [i for m in self.START if (i := text.find(m)) >= 0]
        return min(found) if found else -1

    # True: nothing is streamed before the end (formats where the whole output is one call list).
    hold_all = False

    def spans(self, text: str, start: int, final: bool) -> list[Span]:
        raise NotImplementedError

    def read_call(self, span: Span) -> tuple[str, str]:
        """(name, arguments JSON) of one closed span; raises BadCall."""
        raise NotImplementedError

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        return [self.read_call(span)]

    def content_before(self, text: str) -> str:
        if not text.strip():
            return ""
        return text.rstrip() if self.trim_content else text

    # -- shared machinery --

    def judge(self, text: str, span: Span) -> tuple[list[ToolCall], CallError | None]:
        raw = text[span.start : span.end]
        if not span.closed:
            return [], CallError(UNCLOSED_CALL, "the tool call was not closed (cut off or missing end tag)", raw)
        try:
            calls = []
            for name, arguments in self.read_calls(span):
                self.tools.check(name, arguments)
                calls.append(ToolCall(self.new_id(), name, arguments))
            return calls, None
        except BadCall as e:
            return [], CallError(e.kind, str(e), raw, e.name)

    def extract(self, text: str) -> ExtractedToolCalls:
        start = self.region_start(text)
        if start < 0:
            return ExtractedToolCalls(False, [], text or None)
        content = self.content_before(text[:start])
        calls: list[ToolCall] = []
        errors: list[CallError] = []
        for span in self.spans(text, start, True):
            good, error = self.judge(text, span)
            calls += good
            if error is not None:
                errors.append(error)
                content += error.text
        return ExtractedToolCalls(bool(calls), calls, content or None, errors)

    def streamer(self) -> FormatStreamer:
        return FormatStreamer(self)


class FormatStreamer:
    """Streams a CallFormat: content until the call region starts, then each call as its span closes."""

    def __init__(self, fmt: CallFormat):
        self.fmt = fmt
        self.text = ""
        self.content_sent = 0  # characters of the pre-call text sent
        self.region = -1
        self.spans_done = 0
        self.calls_sent = 0

    def feed(self, delta_text: str) -> StreamDelta:
        self.text += delta_text
        return self._advance(final=False)

    def finish(self) -> StreamDelta:
        return self._advance(final=True)

    def _advance(self, final: bool) -> StreamDelta:
        out = StreamDelta()
        if self.fmt.hold_all:
            if not final:
                return out
            found = self.fmt.extract(self.text)
            return StreamDelta(found.content or "", call_deltas(0, found.tool_calls), found.errors)
        if self.region < 0:
            self.region = self.fmt.region_start(self.text)
            if self.region < 0:
                upto = len(self.text) if final else len(self.text) - held_suffix_len(self.text, self.fmt.START)
                if not final and (self.fmt.trim_content or not self.text[:upto].strip()):
                    upto = len(self.text[:upto].rstrip())
                out.content = self.text[self.content_sent : upto]
                self.content_sent = max(self.content_sent, upto)
                return out
            before = self.fmt.content_before(self.text[: self.region])
            out.content = before[self.content_sent :]
        if self.fmt.whole_region and not final:
            return out
        spans = self.fmt.spans(self.text, self.region, final)
        for span in spans[self.spans_done :]:
            if not span.closed and not final:
                break
            calls, error = self.fmt.judge(self.text, span)
            out.tool_calls += call_deltas(self.calls_sent, calls)
            self.calls_sent += len(calls)
            if error is not None:
                out.errors.append(error)
                out.content += error.text
            self.spans_done += 1
        return out
