"""Tool calls, reasoning and the token splice on /v1/chat/completions (docs/protocols.md §2.3, §2.10),
through the official SDK against a server started with the hermes and qwen3 parsers.

The tiny model has random weights, so tool calls and reasoning are forced tokens (test-only
`vllm_xargs.forced_token_ids`): the engine emits exactly those first, then samples.
"""

from __future__ import annotations

import json

import httpx
import openai

MODEL = "rlserve-default"
EOS = 2043
THINK_END = 2045
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = [{"role": "user", "content": "weather in SF?"}]


from parser_server import base_url, client, http, tok  # noqa: E402,F401  (shared fixtures)


def forced(tok, text: str, eos: bool = True) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + ([EOS] if eos else [])


def chat(client: openai.OpenAI, ids: list[int], stream: bool = False, thinking: bool = True, **kwargs):
    """Forced `ids` as the completion. With thinking off (qwen3) text without </think> is content;
    with it on, such text would all be reasoning."""
    extra = {"vllm_xargs": {"forced_token_ids": ids}, "return_token_ids": True, **kwargs.pop("extra_body", {})}
    if not thinking:
        extra["chat_template_kwargs"] = {"enable_thinking": False}
    args = {"model": MODEL, "messages": USER, "tools": TOOLS, "max_tokens": len(ids), "seed": 0, **kwargs}
    if stream:
        args["stream_options"] = {"include_usage": True}
    return client.chat.completions.create(**args, stream=stream, extra_body=extra)


def collect(chunks) -> dict:
    """Reassemble a chat stream; checks that every token rides in exactly one chunk."""
    chunks = list(chunks)
    usage = chunks[-1].usage
    body = [c.choices[0] for c in chunks if c.choices]
    assert body[0].delta.role == "assistant" and all(c.delta.role is None for c in body[1:])
    assert all(c.finish_reason is None for c in body[:-1])
    out = {
        "content": "",
        "reasoning": "",
        "calls": {},
        "token_ids": [],
        "logprobs": 0,
        "finish_reason": body[-1].finish_reason,
        "usage": usage,
    }
    for c in body:
        extra = c.delta.model_extra or {}
        assert extra.get("reasoning") == extra.get("reasoning_content")
        out["reasoning"] += extra.get("reasoning") or ""
        out["content"] += c.delta.content or ""
        out["token_ids"] += (c.model_extra or {}).get("token_ids") or []
        out["logprobs"] += len(c.logprobs.content) if c.logprobs else 0
        for tc in c.delta.tool_calls or []:
            if tc.id is not None:
                assert tc.index not in out["calls"] and tc.type == "function"
                out["calls"][tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            out["calls"][tc.index]["arguments"] += tc.function.arguments or ""
    return out


def test_tool_call_with_reasoning_nonstream_and_stream(client: openai.OpenAI, tok) -> None:
    ids = forced(tok, "<think>\nplan</think>\n\n" + CALL)
    r = chat(client, ids, logprobs=True)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.model_extra["token_ids"] == ids
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "SF"}
    msg = choice.message.model_extra
    assert msg["reasoning"] == msg["reasoning_content"] == "\nplan"
    assert choice.message.content is None  # only whitespace before the first <tool_call>: vLLM 0.32 sends none
    assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(THINK_END) + 1
    assert len(choice.logprobs.content) == len(ids)

    s = collect(chat(client, ids, stream=True, logprobs=True))
    assert s["finish_reason"] == "tool_calls"
    assert s["token_ids"] == ids and s["logprobs"] == len(ids)  # held-back markup tokens still ride along
    assert s["reasoning"] == "\nplan" and not s["content"]
    (streamed,) = s["calls"].values()
    assert streamed["id"].startswith("chatcmpl-tool-") and streamed["name"] == "get_weather"
    assert streamed["arguments"] == call.function.arguments
    assert s["usage"].completion_tokens_details.reasoning_tokens == ids.index(THINK_END) + 1


def test_tool_calls_win_over_length_and_several_calls(client: openai.OpenAI, tok) -> None:
    two = CALL + "\n" + CALL.replace("SF", "NYC")
    ids = forced(tok, two, eos=False)
    r = chat(client, ids, thinking=False)
    assert r.choices[0].finish_reason == "tool_calls" and len(r.choices[0].model_extra["token_ids"]) == len(ids)
    calls = r.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["SF", "NYC"]
    assert len({c.id for c in calls}) == 2 and r.choices[0].message.content is None
    s = collect(chat(client, ids, stream=True, thinking=False))
    assert s["finish_reason"] == "tool_calls"
    assert [c["arguments"] for c in s["calls"].values()] == [c.function.arguments for c in calls]


def test_tool_choice_none_and_malformed_calls_stay_content(client: openai.OpenAI, tok) -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    for text, tool_choice in ((CALL, "none"), (bad, "auto")):
        ids = forced(tok, text)
        r = chat(client, ids, thinking=False, tool_choice=tool_choice)
        msg = r.choices[0].message
        assert msg.content == text and not msg.tool_calls and r.choices[0].finish_reason == "stop"
        s = collect(chat(client, ids, stream=True, thinking=False, tool_choice=tool_choice))
        assert s["content"] == text and not s["calls"] and s["finish_reason"] == "stop" and s["token_ids"] == ids


def test_named_and_required_tool_choice(client: openai.OpenAI, http: httpx.Client, tok) -> None:
    ids = forced(tok, CALL)
    r = chat(client, ids, thinking=False, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert r.choices[0].message.content == ""  # vLLM's shape for an enforced call: "" beside it, not null
    assert r.choices[0].finish_reason == "stop"  # a call forced by name: vLLM's and OpenAI's finish
    r = chat(client, ids, thinking=False, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content == ""
    cases = [
        {"tool_choice": "required"},
        {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": TOOLS, "tool_choice": "sometimes"},
    ]
    for extra in cases:
        resp = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2, **extra})
        assert resp.status_code == 400, extra
        assert resp.json()["error"]["param"] == "tool_choice"


def test_required_tool_choice_with_defs_in_the_parameters(http: httpx.Client) -> None:
    """Pydantic-made parameters point into their own `$defs`; the enforced call still compiles and fits them."""
    options = {
        "type": "object",
        "properties": {"unit": {"enum": ["c", "f"]}},
        "required": ["unit"],
        "additionalProperties": False,
    }
    params = {
        "type": "object",
        "properties": {"city": {"enum": ["SF"]}, "options": {"$ref": "#/$defs/Options", "description": "units"}},
        "required": ["city", "options"],
        "additionalProperties": False,
        "$defs": {"Options": options},
    }
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    body = {"messages": USER, "tools": tools, "tool_choice": "required", "max_tokens": 300, "seed": 1}
    r = http.post("/v1/chat/completions", json={**body, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text
    (call,) = r.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"])["options"]["unit"] in ("c", "f")


def test_reasoning_split_and_include_reasoning(client: openai.OpenAI, tok) -> None:
    ids = forced(tok, "<think>\nlet me see</think>\n\nhello")
    r = chat(client, ids, tools=openai.omit)
    msg = r.choices[0].message
    assert msg.model_extra["reasoning"] == msg.model_extra["reasoning_content"] == "\nlet me see"
    assert msg.content == "\n\nhello" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens_details.reasoning_tokens == ids.index(THINK_END) + 1
    s = collect(chat(client, ids, stream=True, tools=openai.omit))
    assert s["reasoning"] == "\nlet me see" and s["content"] == "\n\nhello" and s["token_ids"] == ids

    r = chat(client, ids, tools=openai.omit, extra_body={"include_reasoning": False})
    assert r.choices[0].message.model_extra["reasoning"] is None and r.choices[0].message.content == "\n\nhello"
    s = collect(chat(client, ids, stream=True, tools=openai.omit, extra_body={"include_reasoning": False}))
    assert s["reasoning"] == "" and s["content"] == "\n\nhello"
    # no </think> with thinking off: all content (qwen3)
    plain = forced(tok, "just text")
    r = chat(client, plain, thinking=False, tools=openai.omit)
    assert r.choices[0].message.content == "just text" and r.choices[0].message.model_extra["reasoning"] is None
    assert r.usage.completion_tokens_details.reasoning_tokens == 0


def test_token_splice_on_assistant_messages(client: openai.OpenAI, http: httpx.Client, tok) -> None:
    ids = forced(tok, "<think>\nplan</think>\n\n" + CALL)
    r1 = chat(client, ids, logprobs=True)
    call = r1.choices[0].message.tool_calls[0]
    prompt1, gen1 = r1.model_extra["prompt_token_ids"], r1.choices[0].model_extra["token_ids"]
    assistant = {
        "role": "assistant",
        "content": None,
        "reasoning_content": "plan",
        "tool_calls": [call.model_dump()],
        "prompt_token_ids": prompt1,
        "generation_token_ids": gen1,
        "generation_log_probs": [c.logprob for c in r1.choices[0].logprobs.content],
    }
    messages = [*USER, assistant, {"role": "tool", "tool_call_id": call.id, "content": "60F"}]
    r2 = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, max_tokens=2, extra_body={"return_token_ids": True}
    )
    prompt2 = r2.model_extra["prompt_token_ids"]
    assert prompt2[: len(prompt1) + len(gen1)] == prompt1 + gen1
    rest = tok.decode(prompt2[len(prompt1) + len(gen1) :])
    assert rest == "\n<|im_start|>user\n<tool_response>\n60F\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    # /tokenize renders the same splice; without the token fields the template re-renders the turn
    assert http.post("/tokenize", json={"messages": messages, "tools": TOOLS}).json()["tokens"] == prompt2
    plain = [*USER, {k: v for k, v in assistant.items() if "token" not in k and "log_probs" not in k}, messages[2]]
    assert http.post("/tokenize", json={"messages": plain, "tools": TOOLS}).json()["tokens"] != prompt2
    partial = {**assistant}
    del partial["generation_token_ids"]
    resp = http.post("/v1/chat/completions", json={"messages": [*USER, partial, messages[2]], "max_tokens": 2})
    assert resp.status_code == 400 and "token" in resp.json()["error"]["message"]
