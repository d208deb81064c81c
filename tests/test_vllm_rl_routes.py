"""vLLM 0.32's RL control routes where rlserve answered differently: /pause's defaults (abort in-flight,
clear the prefix cache), /update_weight_version's and /load's keys, /abort_requests with vLLM's internal
ids, /weight_info and /weight_checker (checksum, compare, reset)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from conftest import start_server, stop_server


@pytest.fixture(scope="module")
def url():
    url, proc = start_server()
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(autouse=True)
def _resumed(url):
    """A test that fails while the server is paused must not leave every later test's request queued."""
    yield
    httpx.post(f"{url}/resume", timeout=60)


def _queued_behind_a_pause(url: str, rid: str) -> tuple[threading.Thread, dict]:
    """A streaming completion that a keep-pause holds in the engine's queue: in flight however fast the
    engine runs, until the test aborts it. Returns its thread and what it saw (finish reason, chunk id)."""
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=60).json() == {"status": "paused"}
    seen = {"finish": None, "id": None}

    def run() -> None:
        body = {"prompt": "hello", "max_tokens": 8, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers={"x-request-id": rid}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    seen["id"] = chunk["id"]
                    seen["finish"] = chunk["choices"][0]["finish_reason"] or seen["finish"]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, seen


def _until_one_aborted(call: Callable[[], httpx.Response]) -> dict:
    """Repeat an aborting call until it finds the queued request (the stream's POST may not have reached the
    engine yet); each call before that aborts nothing."""
    for _ in range(600):
        r = call()
        assert r.status_code == 200, r.text
        if r.json()["aborted"]:
            return r.json()
        time.sleep(0.05)
    raise AssertionError("the queued request never reached the engine")


def test_pause_defaults_to_vllms_abort(url):
    thread, seen = _queued_behind_a_pause(url, "pause-default")
    assert _until_one_aborted(lambda: httpx.post(f"{url}/pause", timeout=60))["status"] == "paused"
    thread.join(120)
    assert seen["finish"] == "abort"
    assert httpx.get(f"{url}/is_paused").json() == {"is_paused": True}
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}


def test_abort_requests_takes_vllm_internal_ids(url):
    thread, seen = _queued_behind_a_pause(url, "by-internal-id")
    # vLLM's internal id of a completion's choice 0: the completion's id, then -0
    abort = {"request_ids": ["cmpl-by-internal-id-0"]}
    assert _until_one_aborted(lambda: httpx.post(f"{url}/abort_requests", json=abort, timeout=60))["aborted"] == 1
    thread.join(120)
    assert seen == {"finish": "abort", "id": "cmpl-by-internal-id"}
    assert httpx.post(f"{url}/resume").json() == {"status": "resumed"}


def test_version_and_load_keys(url):
    r = httpx.post(f"{url}/update_weight_version", json={"new_version": "step-7"})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["new_version"] == "step-7"
    assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "step-7"
    load = httpx.get(f"{url}/load").json()
    assert "server_load" in load and "load" in load


def test_weight_checker_checksum_compare_reset(url):
    r = httpx.post(f"{url}/weight_checker", json={"action": "checksum"})
    assert r.status_code == 200
    sums = r.json()["checksums"]
    assert sums and all(k.startswith("dp0:pp0:pcp0:tp0:") and len(v) == 64 for k, v in sums.items())
    assert httpx.get(f"{url}/weight_info", params={"checksums": "true"}).json()["checksums"] == sums
    assert httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": sums}).json() == {
        "match": True,
        "mismatches": [],
    }
    assert httpx.post(f"{url}/weight_checker", json={"action": "compare"}).status_code == 400
    assert httpx.post(f"{url}/weight_checker", json={"action": "nope"}).status_code == 400
    assert httpx.post(f"{url}/weight_checker", json={"action": "reset"}).json() == {"status": "reset"}
    after = httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": sums}).json()
    assert after["match"] is False and set(after["mismatches"]) == set(sums)


def test_collective_rpc_runs_only_its_allow_list(url):
    r = httpx.post(f"{url}/collective_rpc", json={"method": "execute_model"})
    assert r.status_code == 400
    assert "reload_weights" in r.json()["error"]["message"] and "execute_model" in r.json()["error"]["message"]
    httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=120).raise_for_status()
    r = httpx.post(f"{url}/collective_rpc", json={"method": "compute_weight_checksums"})
    assert r.status_code == 200 and len(r.json()["results"]) == 1
    sums = r.json()["results"][0]
    httpx.post(f"{url}/weight_checker", json={"action": "reset"}).raise_for_status()
    # reload_weights brings the checkpoint back: the checksums match again
    r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=120)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{url}/weight_checker", json={"action": "compare", "baseline": sums}).json()["match"] is True


def test_finish_weight_update_with_nothing_received_moves_only_the_label(url):
    before = httpx.get(f"{url}/weight_info").json()
    assert httpx.post(f"{url}/start_weight_update", json={}).json() == {"message": "Weight update started"}
    r = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "step-9"})
    assert r.status_code == 200 and r.json()["message"] == "Weight update finished"
    after = httpx.get(f"{url}/weight_info").json()
    assert after == {"weight_version": "step-9", "policy_version": before["policy_version"]}


def test_get_response_by_id_from_a_bounded_store(url):
    r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 3}, timeout=120)
    assert r.status_code == 200, r.text
    got = httpx.get(f"{url}/v1/responses/{r.json()['id']}")
    assert got.status_code == 200 and got.json() == r.json()
    r = httpx.post(f"{url}/v1/responses", json={"input": "hi", "max_output_tokens": 3, "store": False}, timeout=120)
    assert httpx.get(f"{url}/v1/responses/{r.json()['id']}").status_code == 404
    assert httpx.get(f"{url}/v1/responses/resp_unknown").status_code == 404


def test_chat_completions_batch_one_choice_per_conversation(url):
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "tell me more"}]]
    common = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/chat/completions/batch", json={"messages": convs, **common}, timeout=120)
    assert r.status_code == 200, r.text
    batch = r.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for conv, choice in zip(convs, batch["choices"]):
        single = httpx.post(f"{url}/v1/chat/completions", json={"messages": conv, **common}, timeout=120).json()
        assert choice["message"]["content"] == single["choices"][0]["message"]["content"]
    assert batch["usage"]["completion_tokens"] == 8
    for bad in ({"messages": convs, "stream": True}, {"messages": []}, {"messages": convs, "n": 2}):
        assert httpx.post(f"{url}/v1/chat/completions/batch", json=bad, timeout=60).status_code == 400
