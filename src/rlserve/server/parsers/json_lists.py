"""Tool-call formats where the calls are one JSON (or Python) list or a run of objects after a marker.

llama3_json / llama4_json (`{"name": …, "parameters": …}`, `;`-separated, optional `<|python_tag|>`),
granite (`<|tool_call|>[…]`), xlam (`[…]`, optionally fenced), phi4_mini_json (`functools[…]`),
mistral (`[TOOL_CALLS]name[ARGS]{…}` repeated), pythonic / llama4_pythonic (`[f(a=1), g(b="x")]`).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from rlserve.server.parsers.base import (
    INVALID_JSON,
    INVALID_SYNTAX,
    BadCall,
    CallFormat,
    ExtractedToolCalls,
    Span,
    arguments_json,
    load_json,
    mistral_call_id,
)


def _calls_from(value: Any, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> list[tuple[str, str]]:
    calls = []
    for obj in value if isinstance(value, list) else [value]:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise BadCall(INVALID_SYNTAX, 'a tool call is not a JSON object with a string "name"')
        key = next((k for k in arg_keys if k in obj), None)
        args = obj[key] if key is not None else {}
        calls.append((obj["name"], args if isinstance(args, str) else arguments_json(args)))
    return calls


class _Region(CallFormat):
    """The call region runs from its marker to the end of the text and is read once, at the end."""

    whole_region = True

    def spans(self, text: str, start: int, final: bool) -> list[Span]:
        return [Span(start, len(text), text[start:], closed=True)]


class Llama3Json(_Region):
    START = ("<|python_tag|>", "{")
    hold_all = True
    _decoder = json.JSONDecoder()

    def content_before(self, text: str) -> str:
        return ""  # vLLM drops any prose around the JSON calls

    def extract(self, text: str) -> ExtractedToolCalls:
        found = super().extract(text)
        if found.errors:  # no call is read: the whole text stays content, prose included (vLLM too)
            found.content = text
        return found

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        body, calls, i = span.body.removeprefix("<|python_tag|>"), [], 0
        while True:
            i = body.find("{", i)
            if i < 0:
                return calls
            try:
                obj, i = self._decoder.raw_decode(body, i)
            except json.JSONDecodeError as e:
                raise BadCall(INVALID_JSON, f"a tool call is not valid JSON: {e}") from None
            calls += _calls_from(obj)


class Granite(_Region):
    START = ("<|tool_call|>",)
    trim_content = True

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        return _calls_from(load_json(span.body.removeprefix("<|tool_call|>").strip(), "the tool calls"))


class Phi4MiniJson(_Region):
    START = ("functools[",)
    hold_all = True

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        return _calls_from(load_json(span.body.removeprefix("functools").strip(), "the tool calls"))


class Xlam(_Region):
    START = ("```json", "[TOOL_CALLS]", "<tool_call>", "[{")
    hold_all = True
    FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```\s*$", re.DOTALL)

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        body = span.body
        m = self.FENCE.match(body)
        if m is not None:
            body = m.group(1)
        for marker in ("[TOOL_CALLS]", "<tool_call>"):
            body = body.removeprefix(marker)
        return _calls_from(load_json(body.removesuffix("</tool_call>").strip(), "the tool calls"))


class Pythonic(_Region):
    START = ("[",)
    hold_all = True
    WRAP = ("<|python_start|>", "<|python_end|>")

    def region_start(self, text: str) -> int:
        # A call list is the whole output, not a list inside prose.
        stripped = text.lstrip().removeprefix(self.WRAP[0]).lstrip()
        return 0 if stripped.startswith("[") else -1

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        body = span.body.strip().removeprefix(self.WRAP[0]).removesuffix(self.WRAP[1]).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError as e:
            raise BadCall(INVALID_SYNTAX, f"the tool calls are not a Python list of calls: {e.msg}") from None
        if not isinstance(tree, ast.List) or not all(isinstance(c, ast.Call) for c in tree.elts):
            raise BadCall(INVALID_SYNTAX, "the tool calls are not a Python list of calls")
        calls = []
        for call in tree.elts:
            if not isinstance(call.func, ast.Name) or call.args:
                raise BadCall(INVALID_SYNTAX, "each tool call must be name(keyword=value, ...)")
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
            except ValueError:
                raise BadCall(INVALID_SYNTAX, f"arguments of {call.func.id} are not literals", call.func.id) from None
            calls.append((call.func.id, arguments_json(args)))
        return calls


class Mistral(CallFormat):
    """v11+: `[TOOL_CALLS]name[ARGS]{…}` per call, arguments kept verbatim; before v11 `[TOOL_CALLS][{…}, …]`."""

    START = ("[TOOL_CALLS]",)
    MARKER = "[TOOL_CALLS]"

    def new_id(self) -> str:
        return mistral_call_id()

    def spans(self, text: str, start: int, final: bool) -> list[Span]:
        if text[start + len(self.MARKER) :].lstrip().startswith(("[", "{")):
            return [Span(start, len(text), text[start + len(self.MARKER) :], closed=final)]
        spans, i = [], start
        while i >= 0:
            j = text.find(self.MARKER, i + len(self.MARKER))
            end = len(text) if j < 0 else j
            spans.append(Span(i, end, text[i + len(self.MARKER) : end], closed=j >= 0 or final))
            i = j
        return spans

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        if span.body.lstrip().startswith(("[", "{")):
            return _calls_from(load_json(span.body.strip(), "the tool calls"), ("arguments",))
        brace = span.body.find("{")
        if brace < 0:
            raise BadCall(INVALID_SYNTAX, "no JSON arguments after the tool name")
        name = span.body[:brace].replace("[ARGS]", "").replace("[CALL_ID]", "").strip()
        load_json(span.body[brace:])
        return [(name, span.body[brace:])]
