"""A trainer's push into a deployment whose replicas each spread a MoE model's experts over two data-parallel
engines (enable_expert_parallel, parallel.dp = 2): the push reaches all four engines, one replica keeps the
deployment's copy of it as a sharded checkpoint (each engine writes its own experts), and a replica killed
afterwards restarts from that copy at the pushed weights and version before it serves again."""

from __future__ import annotations

import json
import os
import signal

import pytest
from safetensors import safe_open

from deploy_helpers import rejoined, replicas, two_replicas_under, wait_for
from rlserve.model.make import make_model
from rlserve.runtime.weight_snapshot import INDEX_FILE
from test_deploy_data_parallel import broadcast_to_every_engine, every_engine_serves


@pytest.fixture(scope="module")
def deployment(root):
    base = make_model("tiny-moe", root / "moe-base", seed=0)
    args = ("--model.name", str(base), "--deployment.snapshot_dir", str(root / "moe-copies"), "--parallel.dp", "2",
            "--parallel.enable_expert_parallel", "true")  # fmt: skip
    with two_replicas_under(root, *args) as (public, admin, _):
        yield public, admin


def test_a_push_under_expert_parallelism_is_kept_and_replayed_after_a_replica_dies(deployment, root):
    _, admin = deployment
    pushed = make_model("tiny-moe", root / "moe-pushed", seed=4)
    version = broadcast_to_every_engine(admin, pushed)

    (copy,) = [p for p in (root / "moe-copies").iterdir() if not p.name.startswith(".")]
    weight_map = json.loads((copy / INDEX_FILE).read_text())["weight_map"]
    parts = sorted(set(weight_map.values()))
    assert parts == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for part in parts:  # each engine wrote experts
        with safe_open(copy / part, "pt") as f:
            assert any(".experts." in name for name in f.keys()), part

    (victim,) = [r for r in replicas(admin) if r["index"] == 1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: rejoined(admin, victim), 600, "replica 1 to restart")
    every_engine_serves(admin, pushed, version, "step-7")
