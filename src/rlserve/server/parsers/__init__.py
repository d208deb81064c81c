"""The tool-call and reasoning parsers, by vLLM's names (`--model.tool_call_parser`, `--model.reasoning_parser`).

One module per format family: tagged.py (calls between tags), json_lists.py (JSON or Python call
lists), harmony.py (gpt-oss), reasoning.py; base.py holds what they share. docs/parsers.md lists the
names and the RL error flag.
"""

from __future__ import annotations

from typing import Any

from rlserve.server.parsers import json_lists, tagged
from rlserve.server.parsers.base import CallFormat
from rlserve.server.parsers.reasoning import REASONING_PARSERS

TOOL_PARSERS: dict[str, type[CallFormat] | None] = {
    "hermes": tagged.Hermes,
    "qwen3_json": tagged.Hermes,
    "qwen3_coder": tagged.Qwen3Xml,
    "qwen3_xml": tagged.Qwen3Xml,
    "glm45": tagged.Glm45,
    "glm47": tagged.Glm45,
    "deepseek_v3": tagged.DeepSeekV3,
    "deepseek_v31": tagged.DeepSeekV31,
    "kimi_k2": tagged.KimiK2,
    "openai": None,  # gpt-oss Harmony: parsers/harmony.py reads reasoning, content and calls together
    "llama3_json": json_lists.Llama3Json,
    "llama4_json": json_lists.Llama3Json,
    "llama4_pythonic": json_lists.Pythonic,
    "pythonic": json_lists.Pythonic,
    "mistral": json_lists.Mistral,
    "granite": json_lists.Granite,
    "internlm": tagged.InternLM,
    "minimax_m2": tagged.MinimaxM2,
    "seed_oss": tagged.SeedOss,
    "xlam": json_lists.Xlam,
    "phi4_mini_json": json_lists.Phi4MiniJson,
}
TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)
REASONING_PARSER_NAMES = tuple(REASONING_PARSERS)
HARMONY = "openai"


def check_tool_parser(name: str) -> None:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSER_NAMES)}")


def get_tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> CallFormat:
    check_tool_parser(name)
    fmt = TOOL_PARSERS[name]
    if fmt is None:
        raise ValueError("the openai tool parser is read by parsers.harmony")
    return fmt(tools)
