"""Client mistakes: OpenAI-style JSON errors with a 4xx status, the same table as docs/errors.md,
and a server that keeps serving afterwards. Plus the API key (docs/protocols.md §2.0, §2.13)."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import assert_documented_error, start_server, stop_server

USER = [{"role": "user", "content": "x"}]

# (case, route, body (dict, or raw text sent as JSON), status, fragment of error.message)
BAD_INPUTS = [
    ("malformed-json", "/v1/completions", '{"prompt": "x",', 400, "not valid JSON"),
    ("body-not-object", "/v1/completions", "[1, 2]", 400, "valid dictionary"),
    ("wrong-type", "/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("prompt-type", "/v1/completions", {"prompt": 123}, 400, "prompt must be a string"),
    ("prompt-empty", "/v1/completions", {"prompt": ""}, 400, "Either prompt or prompt_embeds must be provided"),
    ("prompt-missing", "/v1/completions", {"max_tokens": 1}, 400, "Either prompt or prompt_embeds must be"),
    ("prompt-embeds", "/v1/completions", {"prompt": "x", "prompt_embeds": "AAAA"}, 400, "prompt_embeds is not"),
    ("thinking-budget", "/v1/chat/completions", {"messages": USER, "thinking_token_budget": 8}, 400, "thinking_token"),
    ("token-id-range", "/v1/completions", {"prompt": [1, 99999]}, 400, "token id 99999 is out of vocabulary"),
    ("context-overflow", "/v1/completions", {"prompt": [5] * 600}, 400, "maximum context length is 512 tokens"),
    (
        "chat-overflow",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a " * 600}]},
        400,
        "maximum context length is 512 tokens",
    ),
    (
        "stream-overflow",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a " * 600}], "stream": True},
        400,
        "maximum context length is 512 tokens",
    ),
    ("n-too-large", "/v1/completions", {"prompt": "x", "n": 1000}, 400, "n must be at most"),
    ("n-zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n must be"),
    ("temperature", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature must be"),
    ("top-p", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p must be"),
    ("top-k", "/v1/completions", {"prompt": "x", "top_k": -2}, 400, "top_k must be"),
    ("min-p", "/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p must be"),
    ("max-tokens-zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens must be"),
    ("max-tokens-negative", "/v1/chat/completions", {"messages": USER, "max_tokens": -5}, 400, "max_tokens must be"),
    ("min-tokens", "/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 5}, 400, "min_tokens"),
    ("logprobs-cap", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "max_logprobs"),
    (
        "top-logprobs-cap",
        "/v1/chat/completions",
        {"messages": USER, "logprobs": True, "top_logprobs": 50},
        400,
        "top_logprobs must be",
    ),
    ("stop-token-range", "/v1/completions", {"prompt": "x", "stop_token_ids": [5000]}, 400, "stop_token_ids"),
    ("seed-type", "/v1/chat/completions", {"messages": USER, "seed": "abc"}, 400, "seed"),
    (
        "prompt-logprobs-stream",
        "/v1/completions",
        {"prompt": "x", "prompt_logprobs": 1, "stream": True},
        400,
        "prompt_logprobs is not available with stream",
    ),
    ("penalty", "/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty must be in [-2, 2]"),
    ("unknown-model", "/v1/completions", {"prompt": "x", "model": "nope"}, 404, "does not exist"),
    ("chat-unknown-model", "/v1/chat/completions", {"messages": USER, "model": "nope"}, 404, "does not exist"),
    ("messages-missing", "/v1/chat/completions", {"max_tokens": 1}, 400, "messages"),
    ("messages-empty", "/v1/chat/completions", {"messages": []}, 400, "at least one message"),
    ("message-role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, "role"),
    (
        "both-generation-flags",
        "/v1/chat/completions",
        {"messages": USER, "continue_final_message": True},
        400,
        "cannot both be true",
    ),
    (
        "image-part",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "text only",
    ),
    ("tokenize-nothing", "/tokenize", {}, 400, "send either prompt"),
    ("detokenize-range", "/detokenize", {"tokens": [99999]}, 400, "out of vocabulary"),
    ("unknown-route", "/v1/nothing", {}, 404, "no route"),
    # bodies no route can use: refused before routing (server/limits.py)
    ("not-utf8", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
    ("lone-surrogate", "/v1/completions", '{"prompt": "\\ud800"}', 400, "lone UTF-16 surrogate"),
    (
        "lone-surrogate-model",
        "/v1/chat/completions",
        '{"model": "\\udc00", "messages": [{"role": "user", "content": "x"}]}',
        400,
        "lone UTF-16 surrogate",
    ),
    (
        "lone-surrogate-request-id",
        "/v1/completions",
        '{"prompt": "x", "request_id": "a\\ud83d"}',
        400,
        "lone UTF-16 surrogate",
    ),
    ("lone-surrogate-tokenize", "/tokenize", '{"prompt": "\\udfff"}', 400, "lone UTF-16 surrogate"),
    ("deep-json", "/generate", "[" * 100_000 + "]" * 100_000, 400, "nested too deeply"),
    ("deep-json-update", "/update_weights", '{"a":' * 100_000 + "1" + "}" * 100_000, 400, "nested too deeply"),
    ("non-finite-number", "/v1/completions", '{"prompt": "x", "temperature": Infinity}', 400, "not valid JSON"),
    (
        "logit-bias-infinite",
        "/v1/completions",
        '{"prompt": "x", "logit_bias": {"5": -Infinity}}',
        400,
        "not valid JSON",
    ),
    ("body-too-large", "/v1/completions", '{"prompt": "' + "a" * (9 << 20) + '"}', 413, "server.max_body_bytes"),
    # wrong types on RL and peer-protocol fields name the field
    ("policy-version-type", "/v1/completions", {"prompt": "x", "min_policy_version": "x"}, 400, "min_policy_version"),
    (
        "staleness-type",
        "/v1/chat/completions",
        {"messages": USER, "max_staleness": "x", "policy_version": 0},
        400,
        "max_staleness",
    ),
    (
        "max-policy-version-type",
        "/inference/v1/generate",
        {"token_ids": [1], "max_policy_version": [1]},
        400,
        "max_policy_version",
    ),
    ("trl-generation-kwargs", "/generate", {"prompts": [[1, 2]], "generation_kwargs": "x"}, 400, "generation_kwargs"),
    (
        "trl-truncate",
        "/generate",
        {"prompts": [[1, 2]], "truncate_prompt_tokens": "abc"},
        400,
        "truncate_prompt_tokens",
    ),
    ("sglang-sampling-params", "/generate", {"input_ids": [1, 2], "sampling_params": []}, 400, "sampling_params"),
    (
        "sglang-top-logprobs-num",
        "/generate",
        {"input_ids": [1, 2], "return_logprob": True, "top_logprobs_num": "x"},
        400,
        "top_logprobs_num",
    ),
    ("responses-text-format", "/v1/responses", {"input": "hi", "text": {"format": "x"}}, 400, "text.format"),
    ("abort-ids", "/abort_requests", {"request_ids": 5}, 400, "request_ids"),
    ("generate-logit-bias-list", "/generate", {"prompt": "x", "logit_bias": [1, 2]}, 400, "logit_bias"),
    # accepted before, refused now
    # a custom role goes to the chat template as vLLM passes it (test_vllm_extras); an empty one is refused
    ("chat-role", "/v1/chat/completions", {"messages": [{"role": "", "content": "x"}]}, 400, "messages.0.role"),
    (
        "tool-without-function",
        "/v1/chat/completions",
        {"messages": USER, "tools": [{"type": "function"}]},
        400,
        "tools.0.function",
    ),
    ("max-tokens-bool", "/v1/chat/completions", {"messages": USER, "max_tokens": True}, 400, "max_tokens"),
    (
        "top-logprobs-without-logprobs",
        "/v1/chat/completions",
        {"messages": USER, "top_logprobs": 3},
        400,
        "top_logprobs needs logprobs",
    ),
    (
        "request-chat-template",
        "/v1/chat/completions",
        {"messages": USER, "chat_template": "{{ 'x' }}"},
        400,
        "server.trust_request_chat_template",
    ),
    (
        "tokenize-chat-template",
        "/tokenize",
        {"messages": USER, "chat_template": "{{ 'x' }}"},
        400,
        "server.trust_request_chat_template",
    ),
    ("sglang-unknown-lora", "/generate", {"input_ids": [1, 2], "lora_path": "nope"}, 404, "is not loaded"),
    ("generate-unknown-model", "/inference/v1/generate", {"token_ids": [1], "model": "nope"}, 404, "does not exist"),
    # request caps
    ("stop-count", "/v1/completions", {"prompt": "x", "stop": ["a"] * 65}, 400, "server.max_stop_strings"),
    (
        "stop-length",
        "/v1/chat/completions",
        {"messages": USER, "stop": ["a" * 1025]},
        400,
        "server.max_stop_string_chars",
    ),
    ("text-cannot-fit", "/tokenize", {"prompt": "a" * 100_000}, 400, "maximum context length is 512 tokens"),
    (
        "chat-text-cannot-fit",
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "a" * 100_000}]},
        400,
        "maximum context length is 512 tokens",
    ),
]


@pytest.mark.parametrize(("case", "route", "body", "status", "fragment"), BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input(server: str, case: str, route: str, body, status: int, fragment: str) -> None:
    with httpx.Client(base_url=server, timeout=30) as http:
        if isinstance(body, (str, bytes)):
            r = http.post(route, content=body, headers={"content-type": "application/json"})
        else:
            r = http.post(route, json=body)
        assert r.status_code == status, r.text
        error = r.json()["error"]
        assert fragment in error["message"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("row", BAD_INPUTS, ids=[r[0] for r in BAD_INPUTS])
def test_bad_input_is_documented(row) -> None:
    case, route, _, status, fragment = row
    assert_documented_error(case, route, status, fragment)


def test_server_keeps_serving_after_errors(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="rlserve-default", prompt="x", temperature=-3)
    assert "temperature" in info.value.message
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=USER)
    r = client.completions.create(model="rlserve-default", prompt="still here", max_tokens=2)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_unknown_fields_and_router_defaults_are_ignored(server: str) -> None:
    injected = {
        "no_stop_trim": False,
        "ignore_eos": False,
        "skip_special_tokens": True,
        "echo": False,
        "return_hidden_states": False,
        "separate_reasoning": True,
        "stream_reasoning": True,
        "include_reasoning": True,
        "priority": 0,
        "kv_transfer_params": None,
        "vllm_xargs": {"a": 1},
        "something_new": {"nested": [1, 2]},
        "user": "u",
        "temperature": None,
        "stop": None,
    }
    with httpx.Client(base_url=server, timeout=30) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **injected})
        assert r.status_code == 200, r.text
        assert r.json()["kv_transfer_params"] is None
        r = http.post(
            "/v1/chat/completions/",
            json={"messages": USER, "max_tokens": 1, **injected},
            headers={"X-Session-ID": "s1", "X-data-parallel-rank": "0"},
        )
        assert r.status_code == 200, r.text


def test_api_key_guards_all_but_public_routes() -> None:
    url, proc = start_server("--server.api_key", "secret")
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            for path in ("/v1/models", "/v1/models/"):
                r = http.get(path)
                assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
            r = http.post("/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            assert http.post("/tokenize", json={"prompt": "x"}).status_code == 401
            for path in ("/health", "/metrics", "/liveness", "/ping", "/version"):
                assert http.get(path).status_code == 200, path
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="secret", max_retries=0)
        assert client.models.list().data[0].id == "rlserve-default"
        r = client.completions.create(model="rlserve-default", prompt="x", max_tokens=2)
        assert len(r.choices) == 1
    finally:
        stop_server(proc)
