"""tool_choice "required" / a named function, enforced: a grammar in the tool parser's own format.

The grammar admits exactly what the configured parser extracts as calls, with each call's
arguments held to its function's JSON schema, so the output always parses. One builder per
parser format; a parser without one keeps tool_choice unenforced (as before).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rlserve.engine.structured import JSON_WHITESPACE


def _call_schema(tool: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    fn = tool["function"]
    params = fn.get("parameters") or {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": fn["name"]}, arguments_key: params},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _calls_schema(tools: list[dict[str, Any]], arguments_key: str) -> dict[str, Any]:
    calls = [_call_schema(t, arguments_key) for t in tools]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    return {**schema, "x-guidance": JSON_WHITESPACE}


def _marker(tag: str, added_tokens: set[str]) -> str:
    """A tag that is one added token must be matched as that token (llguidance's `<tag>`), else as text."""
    return tag if tag in added_tokens else json.dumps(tag)


def hermes(tools: list[dict[str, Any]], added_tokens: set[str]) -> dict[str, Any]:
    """`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one or more."""
    schema = json.dumps(_calls_schema(tools, "arguments"))
    body = f'{_marker("<tool_call>", added_tokens)} "\\n" %json {schema} "\\n" {_marker("</tool_call>", added_tokens)}'
    return {"grammar": f'start: call ("\\n" call)*\ncall: {body}\n'}


def llama3_json(tools: list[dict[str, Any]], added_tokens: set[str]) -> dict[str, Any]:
    """`{"name": ..., "parameters": {...}}`."""
    return {"json": _calls_schema(tools, "parameters")}


BUILDERS: dict[str, Callable[[list[dict[str, Any]], set[str]], dict[str, Any]]] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
}


def tool_call_constraint(
    parser: str | None, tools: list[dict[str, Any]] | None, tool_choice: Any, added_tokens: set[str]
) -> dict[str, Any] | None:
    """The structured_outputs spec enforcing tool_choice, or None when nothing is to be enforced."""
    if not tools or parser not in BUILDERS or tool_choice in (None, "auto", "none"):
        return None
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
        tools = [t for t in tools if t["function"]["name"] == name]
    elif tool_choice != "required":
        return None
    return BUILDERS[parser](tools, added_tokens) if tools else None
