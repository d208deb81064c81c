"""A streamed request whose prompt takes several engine steps to prefill (a small step budget) sends
nothing until its first token, as vLLM does: an empty chunk from a prefill step would be timed by
clients as the first token."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import start_server, stop_server

MODEL = "rlserve-default"
PROMPT = list(range(100, 200))  # 100 tokens: 7 steps of a 16-token budget


@pytest.fixture(scope="module")
def http():
    url, proc = start_server("--engine.max_num_batched_tokens", "16")
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            yield c
    finally:
        stop_server(proc)


def _events(http: httpx.Client, route: str, body: dict) -> list[dict]:
    with http.stream("POST", route, json={**body, "model": MODEL, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_a_chunked_prefill_streams_its_first_chunk_with_its_first_token(http: httpx.Client) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    chunks = _events(http, "/v1/completions", body)
    assert [len(c["choices"][0]["token_ids"]) for c in chunks] == [1, 1, 1]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT  # the prompt's ids still ride in the first
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_chunked_prefill_chat_stream_has_one_role_chunk_then_its_tokens(http: httpx.Client) -> None:
    messages = [{"role": "user", "content": " ".join(["word"] * 60)}]
    chunks = _events(http, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "ignore_eos": True})
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert [d.get("role") for d in deltas].count("assistant") == 1 and deltas[0]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
