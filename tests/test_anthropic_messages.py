"""`/v1/messages` (Anthropic Messages, as vLLM 0.32 serves it) through the real `anthropic` SDK, against the
server with the hermes and qwen3 parsers and forced tokens (tests/parser_server.py). Forced tokens make the
tiny random model emit reasoning, text and tool calls."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from parser_server import base_url, client, http, tok  # noqa: F401  (shared fixtures)

MODEL = "rlserve-default"
EOS = 2043
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
TOOLS = [
    {
        "name": "get_weather",
        "description": "weather in a city",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
USER = [{"role": "user", "content": "weather in SF?"}]


@pytest.fixture(scope="module")
def claude(base_url: str) -> anthropic.Anthropic:  # noqa: F811
    return anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0, timeout=60)


def forced(tok, text: str) -> list[int]:  # noqa: F811
    return tok.encode(text, add_special_tokens=False) + [EOS]


def xargs(ids: list[int]) -> dict:
    return {"vllm_xargs": {"forced_token_ids": ids}}


def streamed(claude: anthropic.Anthropic, **kwargs) -> tuple[list, anthropic.types.Message]:
    with claude.messages.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def test_text_matches_chat_and_streams_the_same(claude, client: openai.OpenAI) -> None:  # noqa: F811
    # anthropic 2.x has no temperature argument (newer Claude models sample at 1): it rides in the body
    args = {"model": MODEL, "max_tokens": 6, "messages": USER, "extra_body": {"temperature": 0}}
    m = claude.messages.create(**args, system="be brief")
    assert m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 6
    chat_messages = [{"role": "system", "content": "be brief"}, *USER]
    r = client.chat.completions.create(model=MODEL, max_tokens=6, temperature=0, messages=chat_messages)
    text = "".join(b.text for b in m.content if b.type == "text")
    thinking = "".join(b.thinking for b in m.content if b.type == "thinking")
    assert thinking == (r.choices[0].message.model_extra["reasoning"] or "")
    assert text == (r.choices[0].message.content or "")
    assert m.usage.input_tokens == r.usage.prompt_tokens
    count = claude.messages.count_tokens(model=MODEL, messages=USER, system="be brief")
    assert count.input_tokens == r.usage.prompt_tokens

    events, final = streamed(claude, **args, system="be brief")
    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and kinds[-2] == "message_delta"
    assert events[0].message.usage.input_tokens == r.usage.prompt_tokens
    assert [b.type for b in final.content] == [b.type for b in m.content]
    assert "".join(b.text for b in final.content if b.type == "text") == text
    assert "".join(b.thinking for b in final.content if b.type == "thinking") == thinking
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6


def test_thinking_and_tool_use_nonstream_and_stream(claude, tok) -> None:  # noqa: F811
    ids = forced(tok, "<think>\nplan</think>\n\n" + CALL)
    args = {"model": MODEL, "max_tokens": len(ids), "messages": USER, "tools": TOOLS, "extra_body": xargs(ids)}
    m = claude.messages.create(**args)
    assert [b.type for b in m.content] == ["thinking", "tool_use"]
    assert m.content[0].thinking == "\nplan" and m.content[0].signature
    use = m.content[1]
    assert use.name == "get_weather" and use.input == {"city": "SF"} and use.id.startswith("chatcmpl-tool-")
    assert m.stop_reason == "tool_use" and m.usage.output_tokens == len(ids)

    events, final = streamed(claude, **args)
    kinds = [e.type for e in events if e.type not in ("text", "thinking", "input_json", "signature")]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["thinking", "tool_use"]
    deltas = [e.delta.type for e in events if e.type == "content_block_delta"]
    assert "thinking_delta" in deltas and "signature_delta" in deltas and "input_json_delta" in deltas
    assert [b.type for b in final.content] == ["thinking", "tool_use"]
    assert final.content[1].input == {"city": "SF"} and final.stop_reason == "tool_use"
    assert final.usage.output_tokens == len(ids) and final.usage.input_tokens == m.usage.input_tokens


def test_stop_sequence_and_tool_round_trip(claude, tok, http: httpx.Client) -> None:  # noqa: F811
    ids = forced(tok, "hello world and more")
    args = {"model": MODEL, "max_tokens": len(ids), "messages": USER, "extra_body": xargs(ids)}
    m = claude.messages.create(**args, stop_sequences=["world"], thinking={"type": "disabled"})
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == "world"
    assert [(b.type, b.text) for b in m.content] == [("text", "hello ")]  # qwen3 with thinking off: all text
    m = claude.messages.create(**args)
    assert [b.type for b in m.content] == ["thinking"] and m.stop_reason == "end_turn"
    turn = [
        *USER,
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "SF"}}],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    before = claude.messages.count_tokens(model=MODEL, messages=USER, tools=TOOLS).input_tokens
    after = claude.messages.count_tokens(model=MODEL, messages=turn, tools=TOOLS).input_tokens
    assert after > before
    # the tool result reaches the prompt as a tool message: the template renders its text
    rendered = http.post("/tokenize", json={"messages": [*turn[:1], {"role": "tool", "content": "sunny"}]}).json()
    assert rendered["count"] > 0
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=turn, tools=TOOLS)
    assert m.usage.input_tokens == after and m.stop_reason == "max_tokens"


def test_bad_input_is_an_anthropic_4xx(claude, http: httpx.Client) -> None:  # noqa: F811
    bad = [
        ({"messages": USER}, "max_tokens"),
        ({"messages": USER, "max_tokens": 0}, "max_tokens"),
        ({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 2}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}], "max_tokens": 2},
            "image",
        ),
        ({"messages": USER, "max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
        ({"messages": USER, "max_tokens": 2, "tool_choice": {"type": "tool"}, "tools": TOOLS}, "tool_choice"),
        ({"messages": USER, "max_tokens": 2, "temperature": -1}, "temperature"),
    ]
    for body, word in bad:
        r = http.post("/v1/messages", json={"model": MODEL, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert word in err["error"]["message"], err
    r = http.post("/v1/messages", json={"model": "nope", "messages": USER, "max_tokens": 2})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as info:
        claude.messages.create(model=MODEL, max_tokens=0, messages=USER)
    assert info.value.body["error"]["type"] == "invalid_request_error"
    r = http.post("/v1/messages", json={"model": MODEL, "messages": USER, "max_tokens": 1, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    names = [line.split(": ", 1)[1] for line in r.text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[-1] == "message_stop" and "[DONE]" not in r.text
    assert json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])["message"]["usage"]["output_tokens"] == 0
