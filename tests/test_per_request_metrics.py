"""vLLM's per-request `metrics` (--enable-per-request-metrics): present with vLLM's five fields and definitions on
a one-prompt, n=1 answer, streamed on the usage chunk, null for n>1 or several prompts and without the switch.
Only relations between the fields are checked, never their size (no machine speed is assumed)."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.server.request_metrics import FIELDS

TOKENS = 8


@pytest.fixture(scope="module")
def url():
    # vLLM's launch line: the flag goes through the vLLM dialect
    url, proc = start_server("--enable-per-request-metrics")
    try:
        yield url
    finally:
        stop_server(proc)


def check(metrics: dict, tokens: int) -> None:
    assert set(metrics) == set(FIELDS) and all(v is not None and v >= 0 for v in metrics.values()), metrics
    ttft, generation = metrics["time_to_first_token_ms"], metrics["generation_time_ms"]
    assert metrics["mean_itl_ms"] == pytest.approx(generation / (tokens - 1), rel=1e-9)
    assert metrics["tokens_per_second"] == pytest.approx(tokens / ((ttft + generation) / 1000), rel=1e-6)


def completion(url: str, **body) -> httpx.Response:
    body = {"prompt": [11, 22, 33], "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, **body}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=300)


def test_one_prompt_one_sample_gets_vllms_timing(url):
    check(completion(url).json()["metrics"], TOKENS)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": TOKENS, "ignore_eos": True}
    check(httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=300).json()["metrics"], TOKENS)


def test_streamed_metrics_ride_on_the_usage_chunk(url):
    body = {"prompt": [11, 22, 33], "max_tokens": TOKENS, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream_options": {"include_usage": True}}) as r:
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data: {")]
    *tokens, last = chunks
    assert not any("metrics" in c for c in tokens) and last["choices"] == [] and last["usage"]
    check(last["metrics"], TOKENS)


def test_several_prompts_or_samples_get_none(url):
    assert completion(url, n=2).json()["metrics"] is None
    assert completion(url, prompt=[[11, 22], [33, 44]]).json()["metrics"] is None


def test_without_the_switch_metrics_are_null(server):
    r = httpx.post(f"{server}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=120)
    assert r.status_code == 200 and r.json()["metrics"] is None
