"""Concurrency, client disconnects and /metrics on a real server."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import wait_queued

MODEL = "rlserve-default"


def scrape(server: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of every sample on /metrics."""
    text = httpx.get(f"{server}/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    want = {"model_name": MODEL, "engine": "0", **labels}
    matches = [v for (n, ls), v in samples.items() if n == name and want.items() <= dict(ls).items()]
    assert matches, f"{name}{labels} not on /metrics"
    return sum(matches)


def wait_idle(server: str, timeout: float = 20.0) -> dict:
    """Poll /metrics until nothing runs and no KV block is in use."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(server)
        idle = (
            value(samples, "vllm:num_requests_running") == 0
            and value(samples, "vllm:num_requests_waiting") == 0
            and value(samples, "vllm:kv_cache_usage_perc") == 0
        )
        if idle or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_64_concurrent_streams_complete(server: str) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, int, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"request {i}"}],
            max_tokens=8,
            stream=True,
            seed=i,
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )
        text, tokens, reason = "", 0, None
        async for chunk in stream:
            for c in chunk.choices:
                text += c.delta.content or ""
                tokens += len(c.model_extra.get("token_ids") or [])
                reason = c.finish_reason or reason
        return text, tokens, reason

    async def main() -> list:
        client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=90)
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(64))), timeout=90)
        finally:
            await client.close()

    results = asyncio.run(main())
    assert len(results) == 64
    assert all(tokens == 8 and reason == "length" for _, tokens, reason in results)
    samples = wait_idle(server)
    assert value(samples, "vllm:kv_cache_usage_perc") == 0


def test_disconnect_mid_stream_frees_blocks(server: str) -> None:
    body = {"prompt": "never ending", "max_tokens": 480, "ignore_eos": True, "stream": True}
    # Still running when the client leaves, by construction: queued behind a pause, one engine step gives it its
    # first token and freezes it again, and the client leaves after reading that token.
    before = scrape(server)
    assert httpx.post(f"{server}/pause?mode=keep", timeout=10).status_code == 200

    def client_leaving_after_the_first_event() -> dict:
        with httpx.Client(base_url=server, timeout=120) as http, http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # held: a dropped line iterator would close the response (a disconnect)
            assert next(line for line in lines if line.startswith("data: "))
            return scrape(server)  # frozen, with the client still connected

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            left = pool.submit(client_leaving_after_the_first_event)
            wait_queued(server, 1)
            assert httpx.post(f"{server}/resume", params={"steps": 1}, timeout=120).status_code == 200
            frozen = left.result(timeout=120)
        assert value(frozen, "vllm:num_requests_running") == 1 and value(frozen, "vllm:kv_cache_usage_perc") > 0
    finally:
        assert httpx.post(f"{server}/resume", timeout=10).status_code == 200
    after = wait_idle(server, timeout=30)
    assert value(after, "vllm:num_requests_running") == 0
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    finished = "vllm:request_success_total"
    assert value(after, finished, finished_reason="abort") == value(before, finished, finished_reason="abort") + 1
    assert value(after, finished, finished_reason="length") == value(before, finished, finished_reason="length")


def test_disconnect_while_waiting_for_a_full_answer_aborts(server: str) -> None:
    before = scrape(server)
    body = {"prompt": "long wait", "max_tokens": 480, "ignore_eos": True}
    # paused: the request is admitted but cannot produce a token until the client has left
    assert httpx.post(f"{server}/pause?mode=keep", timeout=10).status_code == 200
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{server}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        wait_idle(server, timeout=30)
    finally:
        assert httpx.post(f"{server}/resume", timeout=10).status_code == 200
    after = wait_idle(server, timeout=30)
    assert value(after, "vllm:kv_cache_usage_perc") == 0
    finished = "vllm:request_success_total"
    assert value(after, finished, finished_reason="abort") == value(before, finished, finished_reason="abort") + 1
    generated = value(after, "vllm:generation_tokens_total") - value(before, "vllm:generation_tokens_total")
    assert generated == 0


def test_metrics_names_and_labels(server: str) -> None:
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0)
    before = scrape(server)
    client.completions.create(model=MODEL, prompt="count me", max_tokens=3, extra_body={"ignore_eos": True})
    after = scrape(server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:num_preemptions_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "rlserve:policy_version",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
    ):
        value(after, name)  # present, with model_name and engine="0"
    info = [dict(ls) for (n, ls) in after if n == "vllm:cache_config_info"]
    assert info and info[0]["block_size"] == "16" and int(info[0]["num_gpu_blocks"]) > 0
    assert value(after, "rlserve:policy_version") == 0

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("vllm:generation_tokens_total") == 3
    assert delta("vllm:request_success_total", finished_reason="length") == 1
    assert delta("vllm:e2e_request_latency_seconds_count") == 1
    assert delta("vllm:request_generation_tokens_sum") == 3
    assert delta("vllm:inter_token_latency_seconds_count") == 2
    assert delta("vllm:prompt_tokens_total") > 0
