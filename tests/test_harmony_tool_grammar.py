"""tool_choice "required" / named is enforced for gpt-oss (the `openai` parser, Harmony): the grammar admits an
optional analysis message and preamble, then one call of an allowed tool in any header form openai-harmony
reads, ended by `<|call|>`; on random weights with Harmony's markers as single special tokens (as in gpt-oss's
vocabulary, `<|call|>` a stop token), every output a server writes comes back as exactly one such call, with
arguments that validate, streamed and not, and no RL error flag."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import jsonschema
import llguidance
import pytest
from transformers import AutoTokenizer

from conftest import start_server, stop_server
from harmony_vocab import make_gpt_oss_shaped, use_harmony_vocab
from rlserve.engine.structured import GrammarChecker
from rlserve.server.parsers.base import Tools
from rlserve.server.parsers.harmony import parse_harmony
from rlserve.server.tool_grammar import tool_call_constraint
from test_tool_grammar import CHOICES, SCHEMAS, TOOLS

MODEL = "gpt-oss-shaped"
USER = [{"role": "user", "content": "weather?"}]
CALL = "<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>"
THOUGHT = "<|channel|>analysis<|message|>Need the time. <b>{}</b><|end|><|start|>assistant"
PREAMBLE = "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant"
ADMITTED = {  # text -> the choices that admit it
    CALL + '{"zone": 3, "label": "x"}<|call|>': set(CHOICES),
    THOUGHT + PREAMBLE + CALL + '{"zone":-2,"label":"","exact":true}<|call|>': set(CHOICES),
    ' to=functions.get_time<|channel|>commentary json<|message|>{"zone": 0, "label": "y"}<|call|>': set(CHOICES),
    '<|channel|>analysis to=functions.get_time json<|message|>{"zone": 1, "label": "z"}<|call|>': set(CHOICES),
    THOUGHT + '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "SF"}<|call|>': {
        "required"
    },
    "<|channel|>final<|message|>It is sunny.<|return|>": set(),
    CALL + '{"zone": 30, "label": "x"}<|call|>': set(),  # outside the schema
    CALL + '{"zone": 3, "label": "x"}': set(),  # unclosed
    CALL.replace("get_time", "get_date") + '{"zone": 3, "label": "x"}<|call|>': set(),
    CALL + '{"zone": 3, "label": "x"}<|call|><|start|>assistant' + CALL + '{"zone": 4, "label": "x"}<|call|>': set(),
}


@pytest.fixture(scope="module")
def gpt_oss_dir(model_dir, tmp_path_factory):
    use_harmony_vocab()
    return make_gpt_oss_shaped(model_dir, tmp_path_factory.mktemp("gpt-oss-shaped"))


@pytest.mark.parametrize("markers", ["special tokens", "text"])
def test_the_grammar_admits_one_allowed_call_and_the_parser_reads_it(model_dir, gpt_oss_dir, markers):
    tok = AutoTokenizer.from_pretrained(gpt_oss_dir if markers == "special tokens" else model_dir)
    checker = GrammarChecker(tok, len(tok))
    added = set(tok.get_added_vocab())
    assert ("<|call|>" in added) == (markers == "special tokens")
    for label, choice in CHOICES.items():
        spec = tool_call_constraint("openai", TOOLS, choice, added, parallel=True)
        grammar = checker.grammar(spec)
        for text, admitted_by in ADMITTED.items():
            matcher = llguidance.LLMatcher(checker.tokenizer(), grammar)
            ids = tok.encode(text, add_special_tokens=False)
            admitted = all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()
            assert admitted == (label in admitted_by), (label, text)
            if admitted:
                parsed = parse_harmony(text, Tools(TOOLS))
                assert len(parsed.calls) == 1 and not parsed.errors, (text, parsed)


@pytest.fixture(scope="module")
def server(gpt_oss_dir) -> Iterator[tuple[str, AutoTokenizer]]:
    url, proc = start_server(
        "--model.name",
        str(gpt_oss_dir),
        "--model.served_model_name",
        MODEL,
        "--model.tool_call_parser",
        "openai",
        "--engine.allow-forced-tokens",
    )
    try:
        yield url, AutoTokenizer.from_pretrained(gpt_oss_dir)
    finally:
        stop_server(proc)


def _choices(url: str, body: dict) -> dict[int, dict]:
    """Per choice index: reasoning, calls [(name, arguments)], errors, finish_reason; streamed or not."""
    if not body["stream"]:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return {
            c["index"]: {
                "reasoning": c["message"].get("reasoning") or "",
                "calls": [
                    (t["function"]["name"], t["function"]["arguments"]) for t in c["message"].get("tool_calls") or []
                ],
                "errors": c.get("tool_call_errors") or [],
                "finish_reason": c["finish_reason"],
            }
            for c in r.json()["choices"]
        }
    out: dict[int, dict] = {}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:]).get("choices", []):
                got = out.setdefault(c["index"], {"reasoning": "", "calls": {}, "errors": [], "finish_reason": None})
                got["reasoning"] += c["delta"].get("reasoning") or ""
                got["errors"] += c.get("tool_call_errors") or []
                got["finish_reason"] = c.get("finish_reason") or got["finish_reason"]
                for t in c["delta"].get("tool_calls") or []:
                    call = got["calls"].setdefault(t["index"], ["", ""])
                    call[0] += t.get("function", {}).get("name") or ""
                    call[1] += t.get("function", {}).get("arguments") or ""
    for got in out.values():
        got["calls"] = [tuple(got["calls"][k]) for k in sorted(got["calls"])]
    return out


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("label", list(CHOICES))
def test_every_output_is_one_allowed_call(server, label, stream):
    url, tok = server
    # random weights would think for thousands of tokens: `<|end|>` is taken wherever the grammar allows it
    end_now = {str(tok.convert_tokens_to_ids("<|end|>")): 100}
    thought = tok.encode("<|channel|>analysis<|message|>Let me think.", add_special_tokens=False)
    for forced in ([], thought):  # the model's own header, and one after an analysis message
        body = {
            "model": MODEL,
            "messages": USER,
            "tools": TOOLS,
            "tool_choice": CHOICES[label],
            "parallel_tool_calls": False,
            "max_tokens": 160,
            "temperature": 1.0,
            "n": 3,
            "seed": 7,
            "logit_bias": end_now,
            "vllm_xargs": {"forced_token_ids": forced},
            "stream": stream,
        }
        choices = _choices(url, body)
        assert sorted(choices) == [0, 1, 2]
        for got in choices.values():
            # vLLM's and OpenAI's: a call forced by name finishes "stop", a required one "tool_calls"
            assert got["finish_reason"] == ("tool_calls" if label == "required" else "stop"), got
            assert not got["errors"], got
            (call,) = got["calls"]
            assert call[0] == "get_time" or (label == "required" and call[0] in SCHEMAS), got
            jsonschema.validate(json.loads(call[1]), SCHEMAS[call[0]])
            assert got["reasoning"] == ("Let me think." if forced else ""), got
