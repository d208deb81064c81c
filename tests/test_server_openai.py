"""OpenAI routes of a real server, driven by the official SDK and httpx (docs/protocols.md §2.2-2.5).

The tiny model has random weights: assertions are on shapes, token ids, logprobs and determinism.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import start_server, stop_server

MODEL = "rlserve-default"
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server: str):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf_tokenizer(http: httpx.Client):
    root = http.get("/v1/models").json()["data"][0]["root"]
    return AutoTokenizer.from_pretrained(root)


def tokenize(http: httpx.Client, **body) -> list[int]:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def assert_versions(choice: dict, num_tokens: int) -> None:
    assert choice["policy_version"] == 0
    assert choice["weight_version"] == "default"
    assert choice["weight_versions"] == [{"version": "default", "policy_version": 0, "start": 0, "end": num_tokens}]


def test_models_card_and_trailing_slashes(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list()
    assert models.data[0].id == MODEL
    assert models.data[0].model_extra["max_model_len"] == 512
    assert client.models.retrieve(MODEL).id == MODEL
    for path in ("/v1/models", "/v1/models/", "/health", "/health/"):
        r = http.get(path, follow_redirects=False)
        assert r.status_code == 200, path
    assert http.get("/health").json() == {"status": "healthy", "model_loaded": True}


def test_completion_basic_fields(client: openai.OpenAI, http: httpx.Client) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="The sky is",
        max_tokens=8,
        seed=3,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = r.choices[0].model_dump()
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert choice["finish_reason"] == "length" and choice["index"] == 0
    assert len(choice["token_ids"]) == 8
    assert choice["prompt_token_ids"] == tokenize(http, prompt="The sky is")
    assert choice["text"] == http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert r.usage.prompt_tokens == len(choice["prompt_token_ids"]) and r.usage.completion_tokens == 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    assert r.usage.prompt_tokens_details is None  # vLLM's default: only with --enable-prompt-tokens-details
    assert_versions(choice, 8)


def test_token_id_prompts_with_n_are_prompt_major(client: openai.OpenAI) -> None:
    prompts = [[10, 20, 30], [40, 50]]
    r = client.completions.create(
        model=MODEL,
        prompt=prompts,
        n=2,
        max_tokens=4,
        seed=1,
        logprobs=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choices = [c.model_dump() for c in r.choices]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert [c["prompt_token_ids"] for c in choices] == [prompts[0], prompts[0], prompts[1], prompts[1]]
    assert all(len(c["token_ids"]) == 4 and len(c["logprobs"]["token_logprobs"]) == 4 for c in choices)
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 16
    # logprobs: 0 -> only the sampled token in each top_logprobs dict
    assert all(len(top) == 1 for c in choices for top in c["logprobs"]["top_logprobs"])


def test_completion_logprobs_shape(client: openai.OpenAI) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt="one two",
        max_tokens=6,
        logprobs=3,
        seed=5,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    choice = r.choices[0].model_dump()
    lp, ids = choice["logprobs"], choice["token_ids"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    assert lp["text_offset"][0] == 0
    assert all(b - a == len(tok) for a, b, tok in zip(lp["text_offset"], lp["text_offset"][1:], lp["tokens"]))
    for tok, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert value <= 0 and 3 <= len(top) <= 4
        assert top[tok] == value  # the sampled token is always among them
    # the same request with ids as tokens
    r2 = client.completions.create(
        model=MODEL,
        prompt="one two",
        max_tokens=6,
        logprobs=3,
        seed=5,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    lp2 = r2.choices[0].logprobs
    assert lp2.tokens == [f"token_id:{t}" for t in ids]
    assert lp2.token_logprobs == lp["token_logprobs"]
    assert all(k.startswith("token_id:") for top in lp2.top_logprobs for k in top)


def test_completion_boolean_logprobs(http: httpx.Client) -> None:
    body = {"prompt": "x y", "max_tokens": 3, "seed": 2, "ignore_eos": True}
    on = http.post("/v1/completions", json={**body, "logprobs": True}).json()["choices"][0]["logprobs"]
    assert len(on["token_logprobs"]) == 3 and all(1 <= len(t) <= 2 for t in on["top_logprobs"])
    off = http.post("/v1/completions", json={**body, "logprobs": False}).json()["choices"][0]
    assert off["logprobs"] is None


def test_echo_and_prompt_scoring(http: httpx.Client) -> None:
    ids = tokenize(http, prompt="alpha beta gamma")
    r = http.post(
        "/v1/completions",
        json={
            "prompt": "alpha beta gamma",
            "echo": True,
            "logprobs": 1,
            "max_tokens": 3,
            "seed": 4,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    ).json()
    choice = r["choices"][0]
    assert choice["text"].startswith("alpha beta gamma")
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    # max_tokens 0 scores the prompt only
    r = http.post(
        "/v1/completions",
        json={
            "prompt": ids,
            "echo": True,
            "logprobs": 1,
            "max_tokens": 0,
            "return_token_ids": True,
            "prompt_logprobs": 1,
        },
    ).json()
    choice = r["choices"][0]
    assert choice["token_ids"] == [] and r["usage"]["completion_tokens"] == 0
    assert choice["text"] == "alpha beta gamma"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    # the echoed logprobs are the prompt logprobs of the actual tokens
    expected = [None] + [choice["prompt_logprobs"][i][str(t)]["logprob"] for i, t in enumerate(ids) if i > 0]
    assert choice["logprobs"]["token_logprobs"] == expected


def test_prompt_logprobs_shape(http: httpx.Client) -> None:
    ids = [100, 200, 300, 400, 500]
    r = http.post("/v1/completions", json={"prompt": [ids], "max_tokens": 1, "prompt_logprobs": 2}).json()
    pl = r["choices"][0]["prompt_logprobs"]
    assert len(pl) == len(ids) and pl[0] is None
    for pos, entry in enumerate(pl[1:], start=1):
        assert str(ids[pos]) in entry and 2 <= len(entry) <= 3
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[0] == 1 and all(isinstance(e["decoded_token"], str) for e in entry.values())
    # chat puts them at the top level
    r = http.post(
        "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "prompt_logprobs": 0, "return_token_ids": True}
    ).json()
    assert len(r["prompt_logprobs"]) == len(r["prompt_token_ids"]) and r["prompt_logprobs"][0] is None
    assert all(len(e) == 1 for e in r["prompt_logprobs"][1:])


def test_chat_basic_and_token_fields(client: openai.OpenAI, http: httpx.Client, hf_tokenizer) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=50,
        max_completion_tokens=5,
        seed=1,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length" and len(choice.token_ids) == 5  # max_completion_tokens wins
    expected = hf_tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert r.prompt_token_ids == list(expected) == tokenize(http, messages=CHAT)
    assert r.usage.prompt_tokens == len(expected) and r.usage.completion_tokens == 5
    assert_versions(choice.model_dump(), 5)


def test_chat_logprobs_match_completions(client: openai.OpenAI, http: httpx.Client) -> None:
    extra = {"return_token_ids": True, "return_tokens_as_token_ids": True, "ignore_eos": True}
    r = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=6, seed=9, logprobs=True, top_logprobs=3, extra_body=extra
    )
    choice = r.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [f"token_id:{t}" for t in choice.token_ids]
    for c in content:
        assert len(c.top_logprobs) == 3 and all(t.token.startswith("token_id:") for t in c.top_logprobs)
        # vLLM's order: the sampled token first, then the best others
        assert (c.top_logprobs[0].token, c.top_logprobs[0].logprob) == (c.token, c.logprob)
        values = [t.logprob for t in c.top_logprobs[1:]]
        assert values == sorted(values, reverse=True)
        assert isinstance(c.bytes, list)
    # the same ids and seed through /v1/completions give the same tokens and logprobs
    comp = http.post(
        "/v1/completions", json={"prompt": r.prompt_token_ids, "max_tokens": 6, "seed": 9, "logprobs": 0, **extra}
    ).json()["choices"][0]
    assert comp["token_ids"] == choice.token_ids
    assert comp["logprobs"]["token_logprobs"] == [c.logprob for c in content]
    # top_logprobs 0 -> empty lists; logprobs false -> null
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True, top_logprobs=0)
    assert all(c.top_logprobs == [] for c in r.choices[0].logprobs.content)
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)
    assert r.choices[0].logprobs is None


def test_chat_message_forms_render_like_hf(http: httpx.Client, hf_tokenizer) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": params}}]
    messages = [
        {"role": "system", "content": "Be brief"},
        {"role": "user", "content": [{"type": "text", "text": "weather in"}, {"type": "text", "text": "SF?"}]},
        {
            "role": "assistant",
            "content": None,
            "reasoning": "need tool",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "SF"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "60F"},
    ]
    hf_messages = [
        messages[0],
        {"role": "user", "content": "weather in\nSF?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "need tool",
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "SF"}}}
            ],
        },
        messages[3],
    ]
    kwargs = {"enable_thinking": False}
    expected = hf_tokenizer.apply_chat_template(
        hf_messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False, **kwargs
    )
    got = tokenize(http, messages=messages, tools=tools, chat_template_kwargs=kwargs)
    assert got == list(expected)
    r = http.post(
        "/v1/chat/completions",
        json={
            "messages": messages,
            "tools": tools,
            "tool_choice": "none",
            "chat_template_kwargs": kwargs,
            "max_tokens": 2,
            "return_token_ids": True,
        },
    ).json()
    assert r["prompt_token_ids"] == got
    # continue_final_message renders the last assistant turn open
    partial = [*CHAT, {"role": "assistant", "content": "Sure, the"}]
    ids = tokenize(http, messages=partial, add_generation_prompt=False, continue_final_message=True)
    assert hf_tokenizer.decode(ids).endswith("Sure, the")


def test_stop_strings_and_stop_tokens(http: httpx.Client) -> None:
    body = {"prompt": "count: one two", "max_tokens": 16, "seed": 11, "ignore_eos": True, "return_token_ids": True}
    free = http.post("/v1/completions", json=body).json()["choices"][0]
    stop = free["text"][4:7]
    assert stop.strip(), free["text"]
    cut = http.post("/v1/completions", json={**body, "stop": stop}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["stop_reason"] == stop
    assert free["text"].startswith(cut["text"]) and stop not in cut["text"]
    assert free["token_ids"][: len(cut["token_ids"])] == cut["token_ids"]
    kept = http.post("/v1/completions", json={**body, "stop": [stop], "include_stop_str_in_output": True}).json()
    assert kept["choices"][0]["text"] == cut["text"] + stop
    aliased = http.post("/v1/completions", json={**body, "stop": [stop], "no_stop_trim": True}).json()
    assert aliased["choices"][0]["text"] == cut["text"] + stop
    token = free["token_ids"][5]
    first = free["token_ids"].index(token)
    by_id = http.post("/v1/completions", json={**body, "stop_token_ids": [token]}).json()["choices"][0]
    assert by_id["token_ids"] == free["token_ids"][: first + 1]
    assert by_id["finish_reason"] == "stop" and by_id["stop_reason"] == token


def test_sampling_knobs(http: httpx.Client) -> None:
    body = {"prompt": [7, 8, 9], "max_tokens": 5, "return_token_ids": True}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["token_ids"]
    top1 = http.post("/v1/completions", json={**body, "top_k": 1, "seed": 3}).json()["choices"][0]["token_ids"]
    assert greedy == top1
    for top_k in (0, -1):  # both mean off
        r = http.post("/v1/completions", json={**body, "top_k": top_k, "min_p": 0.05, "top_p": 0.9, "seed": 1})
        assert r.status_code == 200, r.text
    seeded = [
        http.post("/v1/completions", json={**body, "seed": 42}).json()["choices"][0]["token_ids"] for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    r = http.post("/v1/completions", json={**body, "min_tokens": 10, "max_tokens": 10}).json()
    assert len(r["choices"][0]["token_ids"]) == 10


def test_prefix_cache_and_cache_salt() -> None:
    url, proc = start_server("--enable-prompt-tokens-details")  # vLLM's flag: usage reports cached tokens
    try:
        prompt = list(range(300, 360))  # several 16-token blocks
        body = {"prompt": prompt, "max_tokens": 2, "ignore_eos": True}
        httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": "a"}, timeout=60)
        hit = httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": "a"}, timeout=60).json()
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] >= 48
        miss = httpx.post(f"{url}/v1/completions", json={**body, "cache_salt": "b"}, timeout=60).json()
        assert miss["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        stop_server(proc)


def test_chat_takes_forwarded_prompt_token_ids(http: httpx.Client) -> None:
    """vLLM's P/D reuse: kv_transfer_params.prompt_token_ids is the prompt, whatever the messages render to."""
    body = {"messages": CHAT, "max_tokens": 2, "return_token_ids": True}
    first = http.post("/v1/chat/completions", json=body).json()
    other = [{"role": "user", "content": "something else entirely"}]
    forwarded = {**body, "messages": other, "kv_transfer_params": {"prompt_token_ids": first["prompt_token_ids"]}}
    reused = http.post("/v1/chat/completions", json=forwarded).json()
    assert reused["prompt_token_ids"] == first["prompt_token_ids"]
    bad = http.post("/v1/chat/completions", json={**body, "kv_transfer_params": {"prompt_token_ids": [10**7]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "kv_transfer_params.prompt_token_ids"
    batch = {"messages": [CHAT, other], "max_tokens": 1, "kv_transfer_params": {"prompt_token_ids": [1, 2]}}
    r = http.post("/v1/chat/completions/batch", json=batch)
    assert r.status_code == 400 and "kv_transfer_params.prompt_token_ids" in r.json()["error"]["message"]


def test_server_wide_vllm_switches() -> None:
    """vLLM's --enable-force-include-usage (usage on every chunk though stream_options do not ask),
    --return-tokens-as-token-ids (logprob tokens as token_id:N though the request does not ask) and
    --exclude-tools-when-tool-choice-none (tool_choice none renders no tools)."""
    flags = ("--enable-force-include-usage", "--return-tokens-as-token-ids", "--exclude-tools-when-tool-choice-none")
    url, proc = start_server(*flags)
    try:
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
        body = {"messages": CHAT, "max_tokens": 1, "return_token_ids": True}
        prompts = {
            choice: httpx.post(f"{url}/v1/chat/completions", json={**body, **extra}, timeout=60).json()
            for choice, extra in (("plain", {}), ("none", {"tools": tools, "tool_choice": "none"}))
        }
        rendered = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "tools": tools}, timeout=60).json()["tokens"]
        assert prompts["none"]["prompt_token_ids"] == prompts["plain"]["prompt_token_ids"] != rendered
        body = {"messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": 1, "return_token_ids": True}
        choice = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()["choices"][0]
        labels = [f"token_id:{t}" for t in choice["token_ids"]]
        assert [e["token"] for e in choice["logprobs"]["content"]] == labels
        body = {"prompt": "hi", "max_tokens": 2, "logprobs": 1, "return_token_ids": True}
        choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        for path, extra in (("/v1/chat/completions", {"messages": CHAT}), ("/v1/completions", {"prompt": "hi"})):
            body = {**extra, "max_tokens": 4, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
                assert r.status_code == 200, r.read()
                chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
            assert all(c["usage"] is not None for c in chunks), path
            last = chunks[-1]
            assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4, path
            assert last["usage"]["total_tokens"] == last["usage"]["prompt_tokens"] + 4
    finally:
        stop_server(proc)


def test_echo_respects_skip_special_tokens(http: httpx.Client) -> None:
    ids = tokenize(http, messages=CHAT)
    body = {"prompt": ids, "echo": True, "max_tokens": 1}
    shown = http.post("/v1/completions", json={**body, "skip_special_tokens": False}).json()["choices"][0]["text"]
    hidden = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert shown.startswith("<|im_start|>") and "<|im_start|>" not in hidden


def test_request_id_header_and_body(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc123"})
    assert r.json()["id"] == "cmpl-abc123" and r.headers["x-request-id"] == "abc123"
    r = http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "request_id": "r-9"})
    assert r.json()["id"] == "chatcmpl-r-9"


def _sse(response: httpx.Response) -> list[dict]:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_stream_concatenates_to_nonstream(client: openai.OpenAI, http: httpx.Client) -> None:
    body = {
        "prompt": "stream me",
        "max_tokens": 12,
        "seed": 7,
        "logprobs": 2,
        "return_token_ids": True,
        "ignore_eos": True,
    }
    full = http.post("/v1/completions", json=body).json()
    with http.stream(
        "POST", "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}}
    ) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks = _sse(r)
    *deltas, last = chunks
    # vLLM's streamed usage has the counts only
    assert last["choices"] == [] and last["usage"] == {
        k: full["usage"][k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")
    }
    choice = full["choices"][0]
    assert "".join(c["choices"][0]["text"] for c in deltas) == choice["text"]
    assert [t for c in deltas for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    lps = [v for c in deltas for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert lps == choice["logprobs"]["token_logprobs"]
    assert deltas[0]["choices"][0]["prompt_token_ids"] == full["choices"][0]["prompt_token_ids"]
    assert all(c["choices"][0]["prompt_token_ids"] is None for c in deltas[1:])  # vLLM's key, null after the first
    assert [c["choices"][0]["finish_reason"] for c in deltas] == [None] * (len(deltas) - 1) + ["length"]
    # the SDK reads the same stream
    stream = client.completions.create(
        model=MODEL, prompt="stream me", max_tokens=12, seed=7, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(c.choices[0].text for c in stream) == choice["text"]


def test_chat_stream_concatenates_to_nonstream(client: openai.OpenAI) -> None:
    kwargs = {"model": MODEL, "messages": CHAT, "max_tokens": 10, "seed": 21, "n": 2, "logprobs": True}
    extra = {"return_token_ids": True, "ignore_eos": True}
    full = client.chat.completions.create(**kwargs, extra_body=extra)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}, extra_body=extra)
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    # vLLM sends the prompt's ids with each choice's role chunk, and only there
    roles = [c for c in chunks[:-1] if c.choices[0].delta.role is not None]
    assert len(roles) == 2 and all(c.model_extra["prompt_token_ids"] == full.prompt_token_ids for c in roles)
    assert all("prompt_token_ids" not in c.model_extra for c in chunks if c not in roles)
    for i in range(2):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == i]
        assert mine[0].delta.role == "assistant" and all(c.delta.role is None for c in mine[1:])
        want = full.choices[i]
        assert "".join(c.delta.content or "" for c in mine) == want.message.content
        assert [t for c in mine for t in (c.model_extra.get("token_ids") or [])] == want.token_ids
        assert [x.logprob for c in mine if c.logprobs for x in c.logprobs.content] == [
            x.logprob for x in want.logprobs.content
        ]
        assert mine[-1].finish_reason == "length" and all(c.finish_reason is None for c in mine[:-1])
        assert mine[-1].model_extra["weight_versions"][0]["end"] == 10


def test_tokenize_and_detokenize(http: httpx.Client, hf_tokenizer) -> None:
    for prefix in ("", "/v1"):
        r = http.post(f"{prefix}/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        assert r["tokens"] == hf_tokenizer.encode("Hello world") and r["count"] == len(r["tokens"])
        assert r["max_model_len"] == 512
        assert r["token_strs"] == hf_tokenizer.convert_ids_to_tokens(r["tokens"])
        back = http.post(f"{prefix}/detokenize", json={"tokens": r["tokens"]}).json()
        assert back == {"prompt": "Hello world"}
    r = http.post("/tokenize/", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert r["token_strs"] is None
    assert r["tokens"] == list(hf_tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=False))


def test_max_tokens_beyond_context_is_capped(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={"prompt": [5] * 500, "max_tokens": 100, "ignore_eos": True}).json()
    assert r["usage"]["completion_tokens"] == 12 and r["choices"][0]["finish_reason"] == "length"


def test_multi_prompt_stream_with_echo_matches_nonstream(http: httpx.Client) -> None:
    body = {
        "prompt": ["ab cd", [66, 67, 68]],
        "n": 2,
        "max_tokens": 4,
        "seed": 5,
        "echo": True,
        "logprobs": 1,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    full = http.post("/v1/completions", json=body).json()["choices"]
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = _sse(r)
    for want in full:
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == want["index"]]
        assert "".join(c["text"] for c in mine) == want["text"]
        assert [t for c in mine for t in c["token_ids"]] == want["token_ids"]
        # the second request's prompt logprobs come after a prefix-cache hit, in another batch: not bitwise
        # (2e-7 apart on an AVX-512 machine)
        streamed = [v for c in mine for v in c["logprobs"]["token_logprobs"]]
        wanted = want["logprobs"]["token_logprobs"]
        assert [v is None for v in streamed] == [v is None for v in wanted]  # the first prompt token's
        assert max(abs(a - b) for a, b in zip(streamed, wanted) if a is not None) <= 1e-5
        assert mine[0]["prompt_token_ids"] == want["prompt_token_ids"]
    assert [c["prompt_token_ids"] for c in full] == [full[0]["prompt_token_ids"]] * 2 + [[66, 67, 68]] * 2
