"""`POST /v1/responses` (docs/protocols.md §2.9) through the official SDK: items, usage, streaming
events, the context-length rule, and multi-turn tool use that reuses earlier tokens verbatim."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

MODEL = "rlserve-default"
EOS = 2043
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}]


from parser_server import base_url, client, http, tok  # noqa: E402,F401  (shared fixtures)


def tokenize(http: httpx.Client, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def comparable(response) -> dict:
    """A response without its per-request ids and timestamps."""
    d = response.model_dump(exclude_none=True)
    for key in ("id", "created_at"):
        d.pop(key)
    for item in d["output"]:
        item.pop("id")
        item.pop("parsed", None)
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return d


def test_plain_response_shape(client: openai.OpenAI) -> None:
    r = client.responses.create(
        model=MODEL,
        input="hello there",
        max_output_tokens=6,
        temperature=0.7,
        metadata={"run": "a"},
        extra_body={"seed": 1, "ignore_eos": True},
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.metadata == {"run": "a"} and r.temperature == 0.7 and r.max_output_tokens == 6
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls is True and r.error is None
    # no </think> and thinking on (qwen3): the whole text is reasoning, so no message text
    kinds = [item.type for item in r.output]
    assert kinds == ["reasoning"] and r.output[0].id.startswith("rs_") and r.output[0].summary[0].text
    u = r.usage
    assert u.output_tokens == 6 and u.total_tokens == u.input_tokens + 6
    assert u.output_tokens_details.reasoning_tokens == 6
    assert u.input_tokens_details.cached_tokens >= 0 and u.input_tokens_details.cache_write_tokens == 0
    assert r.model_extra["policy_version"] == 0 and r.model_extra["weight_versions"][0]["end"] == 6

    r = client.responses.create(
        model=MODEL,
        input="hello there",
        max_output_tokens=6,
        extra_body={"seed": 1, "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}},
    )
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "completed"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    assert r.output_text == msg.content[0].text and r.usage.output_tokens_details.reasoning_tokens == 0


def test_stream_matches_nonstream(client: openai.OpenAI, tok) -> None:
    forced = tok.encode("<think>\nhmm</think>\n\nhi", add_special_tokens=False)
    kwargs = {
        "model": MODEL,
        "input": [{"role": "user", "content": "stream please"}],
        "max_output_tokens": 12,
        "extra_body": {
            "seed": 5,
            "ignore_eos": True,
            "return_token_ids": True,
            "vllm_xargs": {"forced_token_ids": forced},
        },
    }
    full = client.responses.create(**kwargs)
    assert [i.type for i in full.output] == ["reasoning", "message"]
    assert full.output[0].summary[0].text == "\nhmm" and full.output_text.startswith("\n\nhi")

    events = list(client.responses.create(**kwargs, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-1] == "response.completed" and events[0].response.status == "in_progress"
    assert "response.reasoning_summary_text.delta" in types and "response.output_text.delta" in types
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [i.id for i in events[-1].response.output]
    assert comparable(events[-1].response) == comparable(full)

    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == full.output_text
    assert comparable(final) == comparable(full)
    last = final.output[-1].model_extra
    assert last["generation_token_ids"][: len(forced)] == forced and len(last["generation_log_probs"]) == 12


def test_tool_call_output_items(client: openai.OpenAI, tok) -> None:
    forced = tok.encode("<think>\nplan</think>\n\n" + CALL, add_special_tokens=False) + [EOS]
    kwargs = {
        "model": MODEL,
        "input": "weather in SF?",
        "tools": TOOLS,
        "max_output_tokens": 64,
        "extra_body": {"vllm_xargs": {"forced_token_ids": forced}},
    }
    r = client.responses.create(**kwargs)
    # only whitespace before the call: no message item (vLLM 0.32's hermes sends no content then)
    assert [i.type for i in r.output] == ["reasoning", "function_call"]
    call = r.output[-1]
    assert call.call_id == call.id and call.call_id.startswith("chatcmpl-tool-") and call.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "SF"}
    assert r.status == "completed" and r.tools[0].name == "get_weather"
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == call.arguments and final.output[-1].arguments == call.arguments
    assert comparable(final)["output"][:1] == comparable(r)["output"][:1]  # call ids are fresh per response
    # tool_choice none: tools are rendered but nothing is parsed
    r = client.responses.create(**kwargs, tool_choice="none")
    assert [i.type for i in r.output] == ["reasoning", "message"] and CALL in r.output_text


def test_multi_turn_tool_use_reuses_exact_tokens(client: openai.OpenAI, http: httpx.Client, tok) -> None:
    forced = tok.encode("<think>\nplan</think>\n\n" + CALL, add_special_tokens=False) + [EOS]
    first_input = [{"role": "developer", "content": "use tools"}, {"role": "user", "content": "weather in SF?"}]
    r1 = client.responses.create(
        model=MODEL,
        input=first_input,
        instructions="be brief",
        tools=TOOLS,
        max_output_tokens=64,
        extra_body={"return_token_ids": True, "vllm_xargs": {"forced_token_ids": forced}},
    )
    last = r1.output[-1].model_extra
    prompt1, gen1 = last["prompt_token_ids"], last["generation_token_ids"]
    assert gen1 == forced and len(last["generation_log_probs"]) == len(forced)
    assert all("prompt_token_ids" not in i.model_extra for i in r1.output[:-1])
    # instructions and the leading developer message fold into one system message
    chat = [{"role": "system", "content": "be brief\n\nuse tools"}, {"role": "user", "content": "weather in SF?"}]
    assert prompt1 == tokenize(http, messages=chat, tools=CHAT_TOOLS)

    call = r1.output[-1]
    second_input = [
        *first_input,
        *[i.model_dump(exclude_none=True) for i in r1.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "60F"},
    ]
    r2 = client.responses.create(
        model=MODEL,
        input=second_input,
        instructions="be brief",
        tools=TOOLS,
        max_output_tokens=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    prompt2 = r2.output[-1].model_extra["prompt_token_ids"]
    assert prompt2[: len(prompt1) + len(gen1)] == prompt1 + gen1
    rest = tok.decode(prompt2[len(prompt1) + len(gen1) :])
    assert rest == "\n<|im_start|>user\n<tool_response>\n60F\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert r2.usage.input_tokens == len(prompt2)
    assert r2.usage.input_tokens_details.cached_tokens >= len(prompt1) // 16 * 16 - 16  # the prefix cache hit


def test_developer_role_and_instructions(client: openai.OpenAI, http: httpx.Client) -> None:
    items = [{"role": "user", "content": "hi"}, {"role": "developer", "content": "late rule"}]
    body = {"input": items, "max_output_tokens": 1, "return_token_ids": True}
    plain = http.post("/v1/responses", json=body).json()
    assert plain["output"][-1]["prompt_token_ids"] == tokenize(http, messages=items)
    swapped = http.post("/v1/responses", json={**body, "replace_developer_role_with_system": True}).json()
    as_system = [items[0], {"role": "system", "content": "late rule"}]
    assert swapped["output"][-1]["prompt_token_ids"] == tokenize(http, messages=as_system)
    assert swapped["output"][-1]["prompt_token_ids"] != plain["output"][-1]["prompt_token_ids"]


def test_metadata_json_strings_merge_under_request_fields(http: httpx.Client) -> None:
    """NeMo Gym sends chat_template_kwargs and extra_body as JSON strings in metadata."""
    meta = {"chat_template_kwargs": json.dumps({"enable_thinking": False}), "extra_body": json.dumps({"seed": 3})}
    body = {"input": "hi", "max_output_tokens": 4, "return_token_ids": True, "ignore_eos": True, "metadata": meta}
    r = http.post("/v1/responses", json=body).json()
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    assert r["output"][-1]["prompt_token_ids"] == tokenize(http, messages=[{"role": "user", "content": "hi"}], **off)
    assert r["metadata"] == meta
    again = http.post(
        "/v1/responses", json={**body, "metadata": {"chat_template_kwargs": meta["chat_template_kwargs"]}, "seed": 3}
    ).json()
    assert again["output"][-1]["generation_token_ids"] == r["output"][-1]["generation_token_ids"]
    bad = http.post("/v1/responses", json={**body, "metadata": {"extra_body": "{not json"}})
    assert bad.status_code == 400 and "metadata.extra_body" in bad.json()["error"]["message"]


def test_context_overflow_is_an_empty_incomplete_response(client: openai.OpenAI) -> None:
    long = "a " * 600
    r = client.responses.create(model=MODEL, input=long, extra_body={"return_token_ids": True})
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [i.type for i in r.output] == ["message"] and r.output_text == ""
    assert r.usage.output_tokens == 0 and r.usage.input_tokens > 512
    assert "prompt_token_ids" not in r.output[0].model_extra
    with client.responses.stream(model=MODEL, input=long) as stream:
        final = stream.get_final_response()
    assert final.status == "incomplete" and final.output_text == "" and final.usage.output_tokens == 0


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.0"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input.0.call_id"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input.0.content"),
        ({"input": [{"role": "assistant", "content": "x", "prompt_token_ids": [1]}]}, "input.0"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0"),
    ],
)
def test_bad_requests_are_400(http: httpx.Client, body: dict, param: str) -> None:
    r = http.post("/v1/responses", json={"max_output_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
