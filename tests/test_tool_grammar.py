"""tool_choice "required" / named is enforced in every parser format that has a grammar: on random weights
(the hardest case), every output the constrained engine writes is read by that same parser as a call of an
allowed tool, with arguments that validate against the tool's schema, and with no RL error flag. (The tools close
their schemas and bound their free strings, as a random model would otherwise write extra keys and text forever.)"""

from __future__ import annotations

import json

import jsonschema
import pytest

from rlserve.engine.params import SamplingParams
from rlserve.server.parsers import HARMONY, get_tool_parser
from rlserve.server.tool_grammar import BUILDERS, tool_call_constraint
from test_engine import make_engine, random_prompts

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"enum": ["SF", "NYC"]}, "unit": {"type": "string", "enum": ["c", "f"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {
                    "zone": {"type": "integer", "minimum": -12, "maximum": 12},
                    "label": {"type": "string", "maxLength": 6},
                    "exact": {"type": "boolean"},
                },
                "required": ["zone", "label"],
                "additionalProperties": False,
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_time"}}}


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


# gpt-oss's Harmony is read by its own parser, on a vocabulary of its own: tests/test_harmony_tool_grammar.py
@pytest.mark.parametrize("parser", sorted(set(BUILDERS) - {HARMONY}))
def test_every_output_parses_as_an_allowed_call(engine, parser):
    added = set(engine.tokenizer.get_added_vocab())
    prompt = random_prompts(1, engine.vocab_size, seed=3)[0]
    params = [
        SamplingParams(
            temperature=1.0,
            max_tokens=160,
            seed=7,
            n=2,
            structured_outputs=tool_call_constraint(parser, TOOLS, choice, added, parallel=False),
        )
        for choice in CHOICES.values()
    ]
    outputs = engine.generate([prompt] * len(CHOICES), params)  # both choices in one batch
    for label, out in zip(CHOICES, outputs):
        for completion in out.outputs:
            text = completion.text
            assert completion.finish_reason == "stop", (parser, label, text)
            parsed = get_tool_parser(parser, TOOLS).extract(text)
            assert len(parsed.tool_calls) == 1 and not parsed.errors, (parser, label, text, parsed.errors)
            for call in parsed.tool_calls:
                assert call.name == "get_time" or (label == "required" and call.name in SCHEMAS), (parser, text)
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


def test_tool_choice_without_a_call_to_force_is_left_free():
    assert tool_call_constraint("hermes", TOOLS, "none", set()) is None
    assert tool_call_constraint("hermes", TOOLS, "auto", set()) is None
    assert tool_call_constraint("hermes", None, "required", set()) is None
    assert tool_call_constraint(None, TOOLS, "required", set()) is None
