"""tool_choice "required" / a named function, enforced: a grammar in the tool parser's own format.

The grammar admits exactly what the configured parser (server/parsers/) extracts as calls, with each
call's arguments held to its function's JSON schema, so the output always parses. One builder per
format family. JSON-argument formats hold the arguments with llguidance's `%json`; formats that write
one tag per parameter (Qwen3-Coder XML, GLM, MiniMax, pythonic) hold each parameter's value to its
property schema, a string as free text up to the closing tag. gpt-oss (Harmony) writes one call per
turn, after optional free analysis and preamble messages.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlserve.engine.structured import JSON_WHITESPACE

Tool = dict[str, Any]


def _function(tool: Tool) -> tuple[str, dict[str, Any]]:
    fn = tool["function"]
    return fn["name"], _inline_local_refs(fn.get("parameters") or {"type": "object"})


_LOCAL_REF = ("#/$defs/", "#/definitions/")


def _inline_local_refs(params: Any) -> Any:
    """The parameters' `#/$defs/X` refs replaced by X itself: the grammars embed parameters inside a larger
    schema (or write one parameter at a time), where a pointer from the parameters' root finds nothing. A
    recursive definition stays a ref (and the grammar then reports it)."""
    if not isinstance(params, dict):
        return params
    defs = {**(params.get("definitions") or {}), **(params.get("$defs") or {})}
    if not defs:
        return params
    unresolved = False

    def walk(node: Any, inside: frozenset[str]) -> Any:
        nonlocal unresolved
        if isinstance(node, list):
            return [walk(item, inside) for item in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(_LOCAL_REF):
            key = ref.split("/", 2)[2]
            if key in defs and key not in inside and isinstance(defs[key], dict):
                siblings = {k: walk(v, inside) for k, v in node.items() if k != "$ref"}
                return {**walk(defs[key], inside | {key}), **siblings}
            unresolved = True
        return {k: walk(v, inside) for k, v in node.items()}

    body = walk({k: v for k, v in params.items() if k not in ("$defs", "definitions")}, frozenset())
    return params if unresolved else body


def _lit(text: str) -> str:
    return json.dumps(text)


def _json(schema: Any) -> str:
    schema = schema if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**schema, 'x-guidance': JSON_WHITESPACE})}"


def _marker(tag: str, added_tokens: set[str]) -> str:
    """A tag that is one added token must be matched as that token (llguidance's `<tag>`), else as text."""
    return tag if tag in added_tokens else _lit(tag)


def _call_schema(tool: Tool, arguments_key: str) -> dict[str, Any]:
    name, params = _function(tool)
    return {
        "type": "object",
        "properties": {"name": {"const": name}, arguments_key: params},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(tools: list[Tool], arguments_key: str) -> dict[str, Any]:
    calls = [_call_schema(t, arguments_key) for t in tools]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def _list_schema(tools: list[Tool], arguments_key: str, parallel: bool) -> dict[str, Any]:
    return {"type": "array", "items": _calls_schema(tools, arguments_key), "minItems": 1} | (
        {} if parallel else {"maxItems": 1}
    )


def _lark(start: str, calls: list[str], extra: str = "") -> dict[str, Any]:
    """A Lark grammar whose `start` uses the rule `call`: one alternative per tool, `calls[i]` its body."""
    rules = [f"call_{i}: {body}" for i, body in enumerate(calls)]
    alternatives = " | ".join(f"call_{i}" for i in range(len(calls)))
    return {"grammar": "\n".join([f"start: {start}", f"call: {alternatives}", *rules, extra]) + "\n"}


def _each(tools: list[Tool], body: Callable[[str, dict[str, Any]], str]) -> list[str]:
    return [body(*_function(t)) for t in tools]


def _params(parameters: dict[str, Any], one: Callable[[str, dict[str, Any]], str], sep: str = " ") -> str:
    """The parameters in schema order, optional ones optional; `one(key, schema)` writes one parameter."""
    props = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    parts = [one(key, schema) if key in required else f"({one(key, schema)})?" for key, schema in props.items()]
    return sep.join(parts) if parts else '""'


class TextValues:
    """Parameter values written as text up to a closing tag: a string-typed (or untyped) value is free text
    (with `maxLength`: at most that many characters, none of them a newline or "<"), or one of its enum;
    any other type is JSON. `value` names the rule for one schema and `rules` writes the text rules used."""

    def __init__(self, prefix: str, close: str):
        self.prefix, self.close = prefix, close
        self._rules: dict[str, str] = {}

    def value(self, schema: dict[str, Any]) -> str:
        """The value followed by its closing tag."""
        kind = schema.get("type")
        if not (kind in (None, "string") or isinstance(kind, list)):
            return f"{_json(schema)} {_lit(self.close)}"
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return "(" + " | ".join(_lit(v) for v in enum) + f") {_lit(self.close)}"
        limit = schema.get("maxLength")
        if isinstance(limit, int) and not isinstance(limit, bool) and limit >= 0:
            # a bound and a stop string together trip llguidance; a bounded text that cannot hold the tag
            return f"/[^\\n<]{{0,{limit}}}/ {_lit(self.close)}"
        self._rules[self.prefix] = f"{self.prefix}[stop={_lit(self.close)}]: /(?s:.*)/"
        return self.prefix  # the stop string is the closing tag

    def rules(self) -> str:
        return "\n".join(self._rules.values())


# -- formats whose arguments are one JSON object --------------------------------------------------


def hermes(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more."""
    body = f'{_marker("<tool_call>", added)} "\\n" {_json(_calls_schema(tools, "arguments"))} "\\n" {_marker("</tool_call>", added)}'
    more = ' ("\\n" call)*' if parallel else ""
    return {"grammar": f"start: call{more}\ncall: {body}\n"}


def llama3_json(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`{"name": ..., "parameters": {...}}`."""
    return {"json": {**_calls_schema(tools, "parameters"), "x-guidance": JSON_WHITESPACE}}


def granite(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<|tool_call|>[{"name": ..., "arguments": {...}}]`."""
    return {
        "grammar": f"start: {_marker('<|tool_call|>', added)} {_json(_list_schema(tools, 'arguments', parallel))}\n"
    }


def phi4_mini_json(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`functools[{"name": ..., "arguments": {...}}]`."""
    return {"grammar": f'start: "functools" {_json(_list_schema(tools, "arguments", parallel))}\n'}


def xlam(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """A fenced JSON list: ```` ```json\\n[{"name": ..., "arguments": {...}}]\\n``` ````."""
    return {"grammar": f'start: "```json\\n" {_json(_list_schema(tools, "arguments", parallel))} "\\n```"\n'}


def internlm(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<|action_start|><|plugin|>\\n{"name": ..., "parameters": {...}}<|action_end|>`."""
    opening = f"{_marker('<|action_start|>', added)} {_marker('<|plugin|>', added)}"
    body = f'{opening} "\\n" {_json(_calls_schema(tools, "parameters"))} {_marker("<|action_end|>", added)}'
    return {"grammar": f"start: {body}\n"}


def mistral(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`[TOOL_CALLS]name[ARGS]{...}` (v11+)."""
    tool_calls, args = _marker("[TOOL_CALLS]", added), _marker("[ARGS]", added)
    return _lark("call", _each(tools, lambda name, params: f"{tool_calls} {_lit(name)} {args} {_json(params)}"))


def deepseek_v3(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>name\\n```json\\n{...}\\n```<｜tool▁call▁end｜>…`."""
    m = {t: _marker(t, added) for t in ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>")}
    ends = f"{_marker('<｜tool▁call▁end｜>', added)} {_marker('<｜tool▁calls▁end｜>', added)}"
    sep = m["<｜tool▁sep｜>"]
    return _lark(
        f"{m['<｜tool▁calls▁begin｜>']} {m['<｜tool▁call▁begin｜>']} call {ends}",
        _each(tools, lambda name, params: f'"function" {sep} {_lit(name)} "\\n```json\\n" {_json(params)} "\\n```"'),
    )


def deepseek_v31(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜><｜tool▁calls▁end｜>`."""
    begin = f"{_marker('<｜tool▁calls▁begin｜>', added)} {_marker('<｜tool▁call▁begin｜>', added)}"
    ends = f"{_marker('<｜tool▁call▁end｜>', added)} {_marker('<｜tool▁calls▁end｜>', added)}"
    sep = _marker("<｜tool▁sep｜>", added)
    return _lark(f"{begin} call {ends}", _each(tools, lambda name, params: f"{_lit(name)} {sep} {_json(params)}"))


def kimi_k2(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}…`."""
    begin = f"{_marker('<|tool_calls_section_begin|>', added)} {_marker('<|tool_call_begin|>', added)}"
    ends = f"{_marker('<|tool_call_end|>', added)} {_marker('<|tool_calls_section_end|>', added)}"
    args = _marker("<|tool_call_argument_begin|>", added)
    return _lark(
        f"{begin} call {ends}",
        _each(tools, lambda name, params: f"{_lit(f'functions.{name}:0')} {args} {_json(params)}"),
    )


# -- formats that write one tag per parameter -----------------------------------------------------


def qwen3_xml(
    tools: list[Tool], added: set[str], parallel: bool, open_: str = "<tool_call>", close: str = "</tool_call>"
) -> dict[str, Any]:
    """`<tool_call>\\n<function=name>\\n<parameter=k>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`."""
    text = TextValues("xml_text", "\n</parameter>")

    def param(key: str, schema: dict[str, Any]) -> str:
        return f'{_lit(f"<parameter={key}>" + chr(10))} {text.value(schema)} "\\n"'

    def function(name: str, params: dict[str, Any]) -> str:
        return f"{_lit(f'<function={name}>' + chr(10))} {_params(params, param)}"

    calls = _each(tools, function)  # before text.rules(): writing the calls registers the text rules
    block = f'{_marker(open_, added)} "\\n" call "</function>\\n" {_marker(close, added)}'
    return _lark(block, calls, text.rules())


def seed_oss(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    return qwen3_xml(tools, added, parallel, "<seed:tool_call>", "</seed:tool_call>")


def glm45(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>`."""
    text = TextValues("glm_text", "</arg_value>")

    def param(key: str, schema: dict[str, Any]) -> str:
        return f'{_lit(f"<arg_key>{key}</arg_key>" + chr(10) + "<arg_value>")} {text.value(schema)} "\\n"'

    calls = _each(tools, lambda name, params: f"{_lit(name + chr(10))} {_params(params, param)}")
    return _lark(f"{_marker('<tool_call>', added)} call {_marker('</tool_call>', added)}", calls, text.rules())


def minimax_m2(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`<minimax:tool_call>\\n<invoke name="f">\\n<parameter name="k">v</parameter>\\n</invoke>\\n</minimax:tool_call>`."""
    text = TextValues("mm_text", "</parameter>")

    def param(key: str, schema: dict[str, Any]) -> str:
        return f'{_lit("<parameter name=" + json.dumps(key) + ">")} {text.value(schema)} "\\n"'

    def invoke(name: str, params: dict[str, Any]) -> str:
        return f"{_lit('<invoke name=' + json.dumps(name) + '>' + chr(10))} {_params(params, param)}"

    calls = _each(tools, invoke)
    block = (
        f'{_marker("<minimax:tool_call>", added)} "\\n" call "</invoke>\\n" {_marker("</minimax:tool_call>", added)}'
    )
    return _lark(block, calls, text.rules())


def pythonic(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """`[name(k=value, )]` with Python literals; every argument ends with ", " so optional ones can be left out."""

    def param(key: str, schema: dict[str, Any]) -> str:
        kind = schema.get("type")
        value = {"boolean": '("True" | "False")', "null": '"None"'}.get(kind) if isinstance(kind, str) else None
        return f'{_lit(key + "=")} {value or _json(schema)} ", "'

    return _lark('"[" call "]"', _each(tools, lambda name, params: f'{_lit(name + "(")} {_params(params, param)} ")"'))


# -- gpt-oss Harmony ------------------------------------------------------------------------------

# The header forms vLLM admits and openai-harmony reads alike: the recipient after the channel (as trained)
# or before it, the JSON content type with or without `<|constrain|>`, on any of the three channels.
HARMONY_CHANNELS = ("commentary", "analysis", "final")


def harmony(tools: list[Tool], added: set[str], parallel: bool) -> dict[str, Any]:
    """After the template's `<|start|>assistant`: an optional analysis message and an optional commentary
    preamble (free text, each ended by `<|end|><|start|>assistant`), then
    `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`. `<|call|>` ends the
    turn (a stop token in gpt-oss), so there is one call whatever `parallel` says."""
    m = {t: _marker(t, added) for t in ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>")}
    if "<|end|>" in added:  # a special token cannot occur inside text: the text runs until the token
        text, rules = f"/(?s:.*)/ {m['<|end|>']}", ""
    else:
        text, rules = "harmony_text", f"harmony_text[stop={_lit('<|end|>')}]: /(?s:.*)/"
    then = f'{text} {m["<|start|>"]} "assistant"'
    channel = "(" + " | ".join(_lit(c) for c in HARMONY_CHANNELS) + ")"
    constrain = f'(" " {m["<|constrain|>"]} "json" | " json")'

    def call(name: str, params: dict[str, Any]) -> str:
        to = _lit(f" to=functions.{name}")
        header = f"({m['<|channel|>']} {channel} {to} | {to} {m['<|channel|>']} {channel})"
        return f"{header} {constrain} {m['<|message|>']} {_json(params)} {_marker('<|call|>', added)}"

    analysis = f'({m["<|channel|>"]} "analysis" {m["<|message|>"]} {then})?'
    preamble = f'({m["<|channel|>"]} "commentary" {m["<|message|>"]} {then})?'
    return _lark(f"{analysis} {preamble} call", _each(tools, call), rules)


BUILDERS: dict[str, Callable[[list[Tool], set[str], bool], dict[str, Any]]] = {
    "hermes": hermes,
    "qwen3_json": hermes,
    "llama3_json": llama3_json,
    "llama4_json": llama3_json,
    "granite": granite,
    "phi4_mini_json": phi4_mini_json,
    "xlam": xlam,
    "internlm": internlm,
    "mistral": mistral,
    "deepseek_v3": deepseek_v3,
    "deepseek_v31": deepseek_v31,
    "kimi_k2": kimi_k2,
    "qwen3_xml": qwen3_xml,
    "qwen3_coder": qwen3_xml,
    "seed_oss": seed_oss,
    "glm45": glm45,
    "glm47": glm45,
    "minimax_m2": minimax_m2,
    "pythonic": pythonic,
    "llama4_pythonic": pythonic,
    "openai": harmony,
}


def tool_call_constraint(
    parser: str | None, tools: list[Tool] | None, tool_choice: Any, added_tokens: set[str], parallel: bool = True
) -> dict[str, Any] | None:
    """The structured_outputs spec enforcing tool_choice, or None when nothing is to be enforced. `parallel`
    (the request's parallel_tool_calls) False allows one call where a format could carry several."""
    if not tools or parser not in BUILDERS or tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
    elif tool_choice != "required":
        return None
    return BUILDERS[parser](tools, added_tokens, parallel) if tools else None
