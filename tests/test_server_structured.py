"""Structured outputs over HTTP in vLLM's request shapes, through the official SDK, on the embedded
random-weight model (the hardest case for a constraint): every output validates, tool_choice
required/named always yields a parsed call, bad constraints are 400s."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator

import httpx
import jsonschema
import openai
import pytest

from conftest import start_server, stop_server

MODEL = "rlserve-default"
SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["answer", "score"],
    "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer", "minimum": 0, "maximum": 9}},
}
REGEX = r"[a-d]{3}-[0-9]{2}"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["city"],
                "properties": {"city": {"enum": ["SF", "NYC"]}},
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "additionalProperties": False,
                "required": ["zone"],
                "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
            },
        },
    },
]
USER = [{"role": "user", "content": "answer in JSON"}]


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    # the masked, renormalised distribution is what these tests check: vLLM's raw default would hide it
    url, proc = start_server("--model.tool_call_parser", "hermes", "--engine.logprobs_mode", "processed_logprobs")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=120)


def chat_text(client: openai.OpenAI, stream: bool, **kwargs) -> list[str]:
    args = {"model": MODEL, "messages": USER, "max_tokens": 60, "seed": 3, "temperature": 1.0, **kwargs}
    if not stream:
        return [c.message.content for c in client.chat.completions.create(**args).choices]
    texts: dict[int, str] = {}
    for chunk in client.chat.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
    return [texts[i] for i in sorted(texts)]


def completion_text(client: openai.OpenAI, stream: bool, **kwargs) -> list[str]:
    args = {"model": MODEL, "prompt": "The code is", "max_tokens": 40, "seed": 5, **kwargs}
    if not stream:
        return [c.text for c in client.completions.create(**args).choices]
    texts: dict[int, str] = {}
    for chunk in client.completions.create(**args, stream=True):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    return [texts[i] for i in sorted(texts)]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "shape",
    [
        {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}},
        {"extra_body": {"structured_outputs": {"json": SCHEMA}}},
        {"extra_body": {"guided_json": SCHEMA}},
        {"extra_body": {"guided_json": json.dumps(SCHEMA)}},
    ],
)
def test_chat_json_schema_shapes_validate(client, stream, shape):
    for text in chat_text(client, stream, n=2, **shape):
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("extra", [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}])
def test_completions_regex_shapes_match(client, stream, extra):
    for text in completion_text(client, stream, n=2, extra_body=extra):
        assert re.fullmatch(REGEX, text), text


@pytest.mark.parametrize("stream", [False, True])
def test_choice_and_grammar_shapes(client, stream):
    choices = ["alpha", "beta", "gamma"]
    for extra in ({"guided_choice": choices}, {"structured_outputs": {"choice": choices}}):
        assert set(completion_text(client, stream, extra_body=extra)) <= set(choices)
    for grammar in ('start: "ab" NUM\nNUM: /[0-9]{1,2}/', 'root ::= "ab" [0-9] [0-9]?'):
        for text in chat_text(client, stream, extra_body={"structured_outputs": {"grammar": grammar}}):
            assert re.fullmatch(r"ab[0-9]{1,2}", text), text


def test_json_object_and_logprobs_header(base_url):
    body = {
        "model": MODEL,
        "messages": USER,
        "max_tokens": 8,
        "seed": 1,
        "logprobs": True,
        "response_format": {"type": "json_object"},
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"].startswith("{")
    assert r.headers["x-logprobs-distribution"] == "processed-masked-renormalized"
    r = httpx.post(f"{base_url}/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 2}, timeout=120)
    assert r.headers["x-logprobs-distribution"] == "processed"


def test_allowed_token_ids(base_url):
    allowed = [40, 41, 42]
    body = {
        "model": MODEL,
        "prompt": "hi",
        "max_tokens": 8,
        "allowed_token_ids": allowed,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert set(r.json()["choices"][0]["token_ids"]) <= set(allowed)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_tool_choice_is_enforced_and_always_parses(client, stream, choice):
    args = {
        "model": MODEL,
        "messages": USER,
        "tools": TOOLS,
        "tool_choice": choice,
        "max_tokens": 80,
        "temperature": 1.0,
        "n": 3,
        "seed": 7,
    }
    calls: dict[int, list] = {}
    finish: dict[int, str] = {}
    if stream:
        for chunk in client.chat.completions.create(**args, stream=True):
            for c in chunk.choices:
                for tc in c.delta.tool_calls or []:
                    if tc.function.name:
                        calls.setdefault(c.index, []).append([tc.function.name, ""])
                    calls[c.index][-1][1] += tc.function.arguments or ""
                finish[c.index] = c.finish_reason or finish.get(c.index)
    else:
        for c in client.chat.completions.create(**args).choices:
            calls[c.index] = [[tc.function.name, tc.function.arguments] for tc in c.message.tool_calls or []]
            finish[c.index] = c.finish_reason
    assert sorted(calls) == [0, 1, 2]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for i, made in calls.items():
        assert made and finish[i] == ("tool_calls" if choice == "required" else "stop")  # named: vLLM's "stop"
        for name, arguments in made:
            assert name == "get_time" or (choice == "required" and name in schemas)
            jsonschema.validate(json.loads(arguments), schemas[name])


@pytest.mark.parametrize(
    "body, param, needle",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "objectx"}}}},
            None,
            "objectx",
        ),
        ({"guided_regex": "a(b"}, None, "unclosed group"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, None, "nothing_defined"),
        ({"guided_json": "{not json"}, None, "not valid JSON"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice", "one output constraint"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"allowed_token_ids": ["a"]}, "allowed_token_ids", "allowed_token_ids"),
        ({"allowed_token_ids": [10**9]}, None, "allowed_token_ids"),
    ],
)
def test_bad_constraints_are_400s(base_url, body, param, needle):
    for path, base in (("chat/completions", {"messages": USER}), ("completions", {"prompt": "x"})):
        r = httpx.post(f"{base_url}/v1/{path}", json={"model": MODEL, "max_tokens": 4, **base, **body}, timeout=120)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert needle in err["message"]
        if param is not None:
            assert err["param"] == param


def test_constraints_cross_to_data_parallel_engine_cores():
    url, proc = start_server("--parallel.dp", "2", "--model.tool_call_parser", "hermes")
    try:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        for seed in (1, 2):  # two requests, so both cores are likely to take one; each must hold either way
            for text in chat_text(client, False, n=2, seed=seed, extra_body={"guided_json": SCHEMA}):
                jsonschema.validate(json.loads(text), SCHEMA)
        r = client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, tool_choice="required", max_tokens=80, seed=3
        )
        assert r.choices[0].message.tool_calls and r.choices[0].finish_reason == "tool_calls"
    finally:
        stop_server(proc)
