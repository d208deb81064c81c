"""Staleness held back, not refused: a request that needs a newer policy waits for the update."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.model.make import make_model

ADMIN = {"Authorization": "Bearer admin"}


@pytest.fixture(scope="module")
def held_server(root):
    url, proc = start_server(
        "--weight_roots",
        json.dumps([str(root)]),
        "--server.admin_api_key",
        "admin",
        "--server.max_off_policy_steps",
        "1",
        "--server.policy_wait_s",
        "600",
    )
    try:
        yield url
    finally:
        stop_server(proc)


def _generate(url: str, **fields) -> httpx.Response:
    body = {"token_ids": [5, 6, 7, 8], "sampling_params": {"max_tokens": 3, "temperature": 0}, **fields}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=600)


def test_request_ahead_of_the_server_waits_for_the_update(held_server, root):
    assert _generate(held_server, policy_version=1).status_code == 200  # one step off-policy: starts at once
    result = {}
    waiter = threading.Thread(target=lambda: result.update(r=_generate(held_server, policy_version=2)))
    waiter.start()
    waiter.join(timeout=3)
    assert waiter.is_alive() and not result  # held: the server is 2 versions behind the trainer
    step = make_model("tiny", root / "step-1", seed=1)
    r = httpx.post(f"{held_server}/update_weights", json={"weight_dir": str(step)}, headers=ADMIN, timeout=120)
    assert r.status_code == 200 and r.json()["policy_version"] == 1
    waiter.join(timeout=600)
    r = result["r"]
    assert r.status_code == 200 and r.json()["choices"][0]["policy_version"] == 1


def test_wait_is_bounded_and_the_refusal_names_the_current_version(held_server):
    r = _generate(held_server, min_policy_version=50, policy_wait_s=0.2)
    assert r.status_code == 409 and r.json()["error"]["param"] == "min_policy_version"
    current = r.headers["X-Policy-Version"]
    assert f"server policy_version {current} is older than the 50" in r.json()["error"]["message"]
