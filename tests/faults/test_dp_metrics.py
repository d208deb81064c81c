"""parallel.dp = 2 metrics: every per-request series names the engine that served the request, the per-engine
figures add up to what was sent, and /metrics states each family's HELP and TYPE once (Prometheus' text
format forbids repeats; prometheus_client's own parser silently merges them, so the check here is strict)."""

from __future__ import annotations

import re
from collections import Counter

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server, stop_server

PINNED = {"0": 2, "1": 3}  # engine -> requests sent to it
MAX_TOKENS = 4


@pytest.fixture(scope="module")
def dp_server():
    url, proc = start_server("--parallel.dp", "2")
    try:
        yield url
    finally:
        stop_server(proc)


def strict_families(text: str) -> dict[str, list]:
    """Each family's samples; fails on a repeated HELP/TYPE line or a family whose lines are not together."""
    helps = Counter(re.findall(r"^# HELP (\S+)", text, re.MULTILINE))
    types = Counter(re.findall(r"^# TYPE (\S+)", text, re.MULTILINE))
    repeated = sorted(name for name in helps | types if helps[name] > 1 or types[name] > 1)
    assert not repeated, f"HELP/TYPE repeated for {repeated}"
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    order = [m.group(1) for m in re.finditer(r"^# TYPE (\S+)", text, re.MULTILINE)]
    assert len(order) == len(set(order)) == len(families)
    return families


def value(samples, name: str, **labels: str) -> float:
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_per_request_series_name_the_engine_that_served(dp_server: str) -> None:
    with httpx.Client(base_url=dp_server, timeout=120) as client:
        for engine, count in PINNED.items():
            for _ in range(count):
                r = client.post(
                    "/v1/completions",
                    headers={"X-data-parallel-rank": engine},
                    json={"prompt": "hello", "max_tokens": MAX_TOKENS, "ignore_eos": True},
                )
                assert r.status_code == 200, r.text
        families = strict_families(client.get("/metrics").text)
    success = families["vllm:request_success"]
    for engine, count in PINNED.items():
        assert value(success, "vllm:request_success_total", engine=engine, finished_reason="length") == count
        assert (
            value(families["vllm:e2e_request_latency_seconds"], "vllm:e2e_request_latency_seconds_count", engine=engine)
            == count
        )
        assert (
            value(families["vllm:request_generation_tokens"], "vllm:request_generation_tokens_sum", engine=engine)
            == count * MAX_TOKENS
        )
        # the engine's own token counter agrees with the server's per-request series
        assert (
            value(families["vllm:generation_tokens"], "vllm:generation_tokens_total", engine=engine)
            == count * MAX_TOKENS
        )
    assert value(success, "vllm:request_success_total") == sum(PINNED.values())
