"""parallel.dp = 2: two engine core processes behind one server; headers pick the engine."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server, stop_server
from rlserve.model.make import make_model
from rlserve.server.engine_death import ENGINE_DIED_EXIT_CODE
from test_engine_process import HANG_GUARD_S, engine_pids, gone, linux_only, wait_until


@pytest.fixture(scope="module")
def dp_server(root):
    url, proc = start_server("--parallel.dp", "2", "--weight_roots", json.dumps([str(root)]))
    try:
        yield url, proc
    finally:
        stop_server(proc)


def per_engine(url: str, name: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out[sample.labels["engine"]] = sample.value
    return out


def complete(url: str, headers: dict[str, str], max_tokens: int = 3) -> httpx.Response:
    return httpx.post(
        f"{url}/v1/completions",
        json={"prompt": "hello there", "max_tokens": max_tokens, "ignore_eos": True},
        headers=headers,
        timeout=HANG_GUARD_S,
    )


def test_rank_header_pins_the_engine(dp_server):
    url, _ = dp_server
    for rank in ("1", "0", "1"):
        before = per_engine(url, "vllm:generation_tokens_total")
        assert complete(url, {"X-data-parallel-rank": rank}).status_code == 200
        after = per_engine(url, "vllm:generation_tokens_total")
        other = "0" if rank == "1" else "1"
        assert after[rank] == before[rank] + 3 and after[other] == before[other]


def test_a_session_sticks_to_one_engine(dp_server):
    url, _ = dp_server
    for session in ("alice", "bob", "carol"):
        before = per_engine(url, "vllm:generation_tokens_total")
        for _ in range(3):
            assert complete(url, {"X-Session-ID": session}, max_tokens=2).status_code == 200
        after = per_engine(url, "vllm:generation_tokens_total")
        grew = sorted(after[e] - before[e] for e in after)
        assert grew == [0, 6], (session, before, after)


def test_unknown_rank_is_a_400(dp_server):
    url, _ = dp_server
    resp = complete(url, {"X-data-parallel-rank": "2"})
    assert resp.status_code == 400 and "names no engine" in resp.json()["error"]["message"]


def test_admin_operations_reach_every_engine(dp_server, root):
    url, _ = dp_server
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=30).status_code == 200
    assert per_engine(url, "rlserve:is_paused") == {"0": 1.0, "1": 1.0}
    # a step-limited resume reaches both engines; with nothing in flight each is frozen again at once
    assert httpx.post(f"{url}/resume", params={"steps": 2}, timeout=30).json() == {"status": "paused", "steps": 2}
    assert per_engine(url, "rlserve:is_paused") == {"0": 1.0, "1": 1.0}
    assert httpx.post(f"{url}/resume", timeout=30).status_code == 200
    assert per_engine(url, "rlserve:is_paused") == {"0": 0.0, "1": 0.0}
    before = per_engine(url, "rlserve:policy_version")
    weights = make_model("tiny", root / "next", seed=5)
    resp = httpx.post(f"{url}/update_weights", json={"weight_dir": str(weights)}, timeout=HANG_GUARD_S)
    assert resp.status_code == 200
    after = per_engine(url, "rlserve:policy_version")
    assert after == {e: v + 1 for e, v in before.items()}
    # both engines now serve the new weights: greedy output agrees across them
    greedy = [
        httpx.post(
            f"{url}/v1/completions",
            json={"prompt": "hi", "max_tokens": 4, "temperature": 0},
            headers={"X-data-parallel-rank": r},
            timeout=HANG_GUARD_S,
        ).json()["choices"][0]["text"]
        for r in ("0", "1")
    ]
    assert greedy[0] == greedy[1]


@linux_only
def test_one_dead_engine_turns_health_503_and_the_server_exits_3():
    """One dead engine of two: /health answers 503 for as long as the server still listens, then the
    server stops with ENGINE_DIED_EXIT_CODE so its supervisor starts a whole replica (docs/faults.md)."""
    url, proc = start_server("--parallel.dp", "2")
    try:
        first, second = engine_pids(proc)
        for pid in (first, second):  # forked from the server (named by setproctitle), not spawned
            assert Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"rlserve.runtime.core ipc://")
        assert httpx.get(f"{url}/health").status_code == 200
        os.kill(second, signal.SIGKILL)
        deadline = time.monotonic() + HANG_GUARD_S
        while proc.poll() is None:
            try:
                status = httpx.get(f"{url}/health", timeout=HANG_GUARD_S).status_code
            except httpx.TransportError:
                break  # the listening socket closed: the server is on its way out
            assert status in (200, 503), status
            assert time.monotonic() < deadline, "hang guard: the server never stopped"
            time.sleep(0.05)
        assert proc.wait(timeout=HANG_GUARD_S) == ENGINE_DIED_EXIT_CODE
        wait_until(lambda: gone(first), "the surviving engine stops with the server")
    finally:
        stop_server(proc)
