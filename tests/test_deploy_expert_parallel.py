"""A trainer's push into a deployment whose replicas each spread a MoE model's experts over two data-parallel
engines (enable_expert_parallel, parallel.dp = 2): the push reaches all four engines, one replica keeps the
deployment's copy of it as a sharded checkpoint (each engine writes its own experts), and a replica killed
afterwards restarts from that copy at the pushed weights and version before it serves again."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from safetensors import safe_open

from deploy_helpers import replicas, start_deployment, stop_deployment, wait_for
from rlserve.model.make import make_model
from rlserve.runtime.weight_snapshot import INDEX_FILE
from test_deploy_data_parallel import every_engine_serves
from test_server_rl import TRAINER, trainer_push


@pytest.fixture(scope="module")
def deployment(root):
    base = make_model("tiny-moe", root / "moe-base", seed=0)
    public, admin, proc = start_deployment(
        "--model.name", str(base),
        "--deployment.replicas", "2",
        "--deployment.snapshot_dir", str(root / "moe-copies"),
        "--parallel.dp", "2",
        "--parallel.enable_expert_parallel", "true",
        "--weight_roots", json.dumps([str(root)]),
        "--engine.kv_cache_bytes", str(16 << 20),
    )  # fmt: skip
    try:
        yield public, admin
    finally:
        stop_deployment(proc)


def restarted(admin: str, victim: dict) -> dict | None:
    (row,) = [r for r in replicas(admin) if r["index"] == victim["index"]]
    assert row["status"] != "stale", f"{row['url']} sits out: {row['detail']}"
    return row if row["status"] == "serving" and row["restarts"] > victim["restarts"] else None


def test_a_push_under_expert_parallelism_is_kept_and_replayed_after_a_replica_dies(deployment, root):
    _, admin = deployment
    assert httpx.get(f"{admin}/get_world_size", timeout=30).json() == {"world_size": 4}
    pushed = make_model("tiny-moe", root / "moe-pushed", seed=4)
    version = replicas(admin)[0]["policy_version"] + 1
    trainer = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")  # pushes with the label "step-7"
    assert trainer_push(admin, pushed, timeout=600, trainer=trainer) == [version]
    every_engine_serves(admin, pushed, version, "step-7")

    (copy,) = [p for p in (root / "moe-copies").iterdir() if not p.name.startswith(".")]
    weight_map = json.loads((copy / INDEX_FILE).read_text())["weight_map"]
    parts = sorted(set(weight_map.values()))
    assert parts == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part in parts:  # each engine wrote experts: the second engine's part holds only experts
        with safe_open(copy / part, "pt") as f:
            assert any(".experts." in name for name in f.keys()), part

    (victim,) = [r for r in replicas(admin) if r["index"] == 1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: restarted(admin, victim), 600, "replica 1 to restart")
    every_engine_serves(admin, pushed, version, "step-7")
