"""Tool-call formats where each call sits between an opening and a closing tag.

hermes / qwen3_json (`<tool_call>{json}</tool_call>`), qwen3_coder / qwen3_xml and seed_oss
(`<function=name><parameter=k>v</parameter></function>`), glm45 / glm47 (`name<arg_key>k</arg_key>
<arg_value>v</arg_value>`), deepseek_v3 / deepseek_v31, kimi_k2, minimax_m2 (`<invoke name=…>`) and
internlm (`<|action_start|><|plugin|>{json}<|action_end|>`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from rlserve.server.parsers.base import (
    INVALID_SYNTAX,
    BadCall,
    CallFormat,
    Span,
    ToolCall,
    arguments_json,
    load_json,
    new_call_id,
)


def tag_spans(text: str, start: int, open_: str, close: str) -> list[Span]:
    spans = []
    i = text.find(open_, start)
    if i < 0:
        return [Span(start, len(text), text[start:], closed=False)]
    while i >= 0:
        j = text.find(close, i + len(open_))
        if j < 0:
            spans.append(Span(i, len(text), text[i + len(open_) :], closed=False))
            break
        spans.append(Span(i, j + len(close), text[i + len(open_) : j]))
        i = text.find(open_, j + len(close))
    return spans


def json_call(body: str, arg_keys: tuple[str, ...] = ("arguments",)) -> tuple[str, str]:
    obj = load_json(body.strip(), "the tool call")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise BadCall(INVALID_SYNTAX, 'the tool call is not a JSON object with a string "name"')
    key = next((k for k in arg_keys if k in obj), None)
    args = obj[key] if key is not None else {}
    return obj["name"], args if isinstance(args, str) else arguments_json(args)


def typed_value(value: str, json_type: Any) -> Any:
    """An XML parameter's text as the type the tool's schema gives it (text when unknown)."""
    if json_type in (None, "string") or isinstance(json_type, list):
        return value
    try:
        if json_type == "integer":
            return int(value)
        if json_type == "number":
            number = float(value)
            return int(number) if number.is_integer() and "." not in value else number
        if json_type == "boolean":
            return {"true": True, "false": False}.get(value.strip().lower(), value)
        return json.loads(value)
    except ValueError:
        return value


class Tagged(CallFormat):
    OPEN = CLOSE = ""

    @property
    def START(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.OPEN,)

    def spans(self, text: str, start: int, final: bool) -> list[Span]:
        return tag_spans(text, start, self.OPEN, self.CLOSE)


class Hermes(Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def read_call(self, span: Span) -> tuple[str, str]:
        return json_call(span.body)


class Qwen3Xml(Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    trim_content = True
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def read_call(self, span: Span) -> tuple[str, str]:
        m = self.FUNCTION.search(span.body)
        if m is None:
            raise BadCall(INVALID_SYNTAX, "no <function=name> in the tool call")
        name = m.group(1).strip()
        args = {}
        for p in self.PARAM.finditer(m.group(2)):
            value = p.group(2).removeprefix("\n").removesuffix("\n")
            args[p.group(1).strip()] = typed_value(value, self.tools.param_type(name, p.group(1).strip()))
        return name, arguments_json(args)


class SeedOss(Qwen3Xml):
    OPEN, CLOSE = "<seed:tool_call>", "</seed:tool_call>"


class Glm45(Tagged):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    trim_content = True
    PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def read_call(self, span: Span) -> tuple[str, str]:
        name = span.body.split("<arg_key>", 1)[0].strip()
        if not name:
            raise BadCall(INVALID_SYNTAX, "no function name after <tool_call>")
        args = {
            k.strip(): typed_value(v, self.tools.param_type(name, k.strip())) for k, v in self.PAIR.findall(span.body)
        }
        return name, arguments_json(args)


class DeepSeekV3(Tagged):
    REGION = "<｜tool▁calls▁begin｜>"
    OPEN, CLOSE, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    BODY = re.compile(r"^\s*function\s*<｜tool▁sep｜>(.*?)\n```json\n(.*)\n```\s*$", re.DOTALL)

    @property
    def START(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.REGION,)

    def read_call(self, span: Span) -> tuple[str, str]:
        m = self.BODY.match(span.body)
        if m is None:
            raise BadCall(INVALID_SYNTAX, "expected function<｜tool▁sep｜>name then a ```json block")
        load_json(m.group(2))
        return m.group(1).strip(), m.group(2)


class DeepSeekV31(DeepSeekV3):
    def read_call(self, span: Span) -> tuple[str, str]:
        name, sep, args = span.body.partition(self.SEP)
        if not sep:
            raise BadCall(INVALID_SYNTAX, "no <｜tool▁sep｜> between the name and the arguments")
        return name.strip(), args


class KimiK2(Tagged):
    REGION = "<|tool_calls_section_begin|>"
    OPEN, CLOSE, ARGS = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"

    @property
    def START(self) -> tuple[str, ...]:  # type: ignore[override]
        return (self.REGION,)

    def read_call(self, span: Span) -> tuple[str, str]:
        call_id, sep, args = span.body.partition(self.ARGS)
        if not sep:
            raise BadCall(INVALID_SYNTAX, "no <|tool_call_argument_begin|> in the tool call")
        return call_id.strip().split(":")[0].split(".", 1)[-1], args.strip()

    def judge(self, text: str, span: Span) -> tuple[list[ToolCall], Any]:
        calls, error = super().judge(text, span)
        for call in calls:  # Kimi's template wants its own ids back: functions.name:index
            call.id = span.body.partition(self.ARGS)[0].strip()
        return calls, error


class MinimaxM2(Tagged):
    OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
    trim_content = True
    INVOKE = re.compile(r'<invoke name="?([^">]+)"?>(.*?)</invoke>', re.DOTALL)
    PARAM = re.compile(r'<parameter name="?([^">]+)"?>(.*?)</parameter>', re.DOTALL)

    def read_calls(self, span: Span) -> list[tuple[str, str]]:
        calls = []
        for m in self.INVOKE.finditer(span.body):
            name = m.group(1).strip()
            args = {
                k.strip(): typed_value(v.strip("\n"), self.tools.param_type(name, k.strip()))
                for k, v in self.PARAM.findall(m.group(2))
            }
            calls.append((name, arguments_json(args)))
        if not calls:
            raise BadCall(INVALID_SYNTAX, "no <invoke name=...> in the tool call block")
        return calls


class InternLM(Tagged):
    OPEN, CLOSE = "<|action_start|><|plugin|>", "<|action_end|>"

    def read_call(self, span: Span) -> tuple[str, str]:
        return json_call(span.body, ("parameters", "arguments"))


__all__ = [
    "DeepSeekV3",
    "DeepSeekV31",
    "Glm45",
    "Hermes",
    "InternLM",
    "KimiK2",
    "MinimaxM2",
    "Qwen3Xml",
    "SeedOss",
    "new_call_id",
]
