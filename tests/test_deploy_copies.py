"""prime-rl's num_infer_replicas: k copies of the inference deployment, each behind its own vllm-router, all
reached by one admin address. Started from an RL config as prime-rl's docs write it: an update (and a trainer's
push) reaches every replica of every copy, both routers serve the new version, a refused update changes none
of them, a copy's dead router comes back on its own URL, and SIGTERM leaves no process."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from deploy_helpers import descendants, sigterm_leaves_nothing, start_deployment, stop_deployment, wait_for
from rlserve.model.make import make_model
from test_server_rl import TRAINER, generate, hf_check, trainer_push

PROMPT = [11, 22, 33, 44, 55]
RL_CONFIG = """
[deployment]  # prime-rl's RL-level deployment: two copies of the inference deployment
num_train_nodes = 1
num_infer_replicas = 2

[inference.deployment]
num_replicas = 2
"""


@pytest.fixture(scope="module")
def copies(root, tmp_path_factory):
    config = tmp_path_factory.mktemp("copies") / "rl.toml"
    config.write_text(RL_CONFIG)
    public, admin, proc = start_deployment(
        "@", str(config), "--weight_roots", json.dumps([str(root)]), "--engine.kv_cache_bytes", str(16 << 20)
    )
    try:
        yield public, admin, proc
    finally:
        stop_deployment(proc)


def _described(admin: str) -> dict:
    return httpx.get(f"{admin}/deployment", timeout=30).json()


def _router_urls(admin: str) -> list[str]:
    return [r["url"] for r in _described(admin)["routers"]]


def test_two_copies_of_two_replicas_each_behind_their_own_router(copies):
    public, admin, _ = copies
    described = _described(admin)
    assert [r["copy"] for r in described["replicas"]] == [0, 0, 1, 1]
    assert all(r["status"] == "serving" for r in described["replicas"])
    routers = _router_urls(admin)
    assert routers[0] == public and len(set(routers)) == 2
    for router in routers:  # each router knows only its own copy's replicas
        workers = httpx.get(f"{router}/list_workers", timeout=30).json()["urls"]
        copy = routers.index(router)
        assert sorted(workers) == sorted(r["url"] for r in described["replicas"] if r["copy"] == copy)
    assert httpx.get(f"{admin}/get_world_size", timeout=30).json() == {"world_size": 4}


def test_one_update_reaches_all_four_replicas_and_a_corrupt_one_none(copies, root):
    _, admin, _ = copies
    step1 = make_model("tiny", root / "step-1", seed=1)
    r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(step1), "weight_version": "step-1"}, timeout=300)
    assert r.status_code == 200, r.text
    for router in _router_urls(admin):
        choice = generate(router, PROMPT)["choices"][0]
        assert choice["policy_version"] == 1 and choice["weight_version"] == "step-1"
        hf_check(step1, PROMPT, choice)
    rows = _described(admin)["replicas"]
    assert [(r["policy_version"], r["weight_version"]) for r in rows] == [(1, "step-1")] * 4
    bad = make_model("tiny", root / "bad", seed=2)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(bad)}, timeout=300)
    assert r.status_code == 400 and "previous weights keep serving" in r.json()["error"]["message"]
    rows = _described(admin)["replicas"]
    assert [(r["status"], r["policy_version"]) for r in rows] == [("serving", 1)] * 4


def test_a_trainer_push_reaches_every_copy(copies, root):
    _, admin, _ = copies
    pushed = make_model("tiny", root / "pushed", seed=4)
    version = _described(admin)["policy_version"] + 1
    no_admin_key = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")
    assert trainer_push(admin, pushed, timeout=300, trainer=no_admin_key) == [version]
    for row in _described(admin)["replicas"]:
        choice = generate(row["url"], PROMPT)["choices"][0]
        assert choice["policy_version"] == version
        hf_check(pushed, PROMPT, choice)


def test_a_copys_dead_router_comes_back_on_its_url(copies):
    _, admin, _ = copies
    before = _described(admin)["routers"][1]
    os.kill(before["pid"], signal.SIGKILL)

    def answers() -> bool:
        try:
            body = {"prompt": [1, 2], "max_tokens": 1}
            return httpx.post(f"{before['url']}/v1/completions", json=body, timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, 120, "copy 1's router to come back")
    after = _described(admin)["routers"][1]
    assert after["url"] == before["url"] and after["pid"] != before["pid"]


def test_sigterm_leaves_no_process(copies):
    _, _, proc = copies
    tree = descendants(proc.pid)
    assert len(tree) >= 6  # 4 replicas and 2 routers, at least
    sigterm_leaves_nothing(proc, tree, 60, "every child to exit")
