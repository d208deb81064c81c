"""A trainer's push into a deployment whose replicas each run parallel.dp = 2: every engine of every replica
is its own member of the trainer's group, so the admin address counts 2 ranks per replica (GET /get_world_size)
and hands each replica its first rank 2 past the previous one's. Both of rlserve's broadcast and vLLM's weight
transfer reach all four engines, which then serve the pushed weights and version."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from deploy_helpers import replicas, two_replicas_under
from rlserve.model.make import make_model
from test_server_rl import TRAINER, hf_check, trainer_push

PROMPT = [11, 22, 33, 44, 55]
VLLM_TRAINER = str(Path(__file__).parent / "vllm_trainer.py")


@pytest.fixture(scope="module")
def deployment(root):
    with two_replicas_under(root, "--parallel.dp", "2") as (public, admin, _):
        yield public, admin


def every_engine_serves(admin: str, model_dir: Path, version: int, label: str | None) -> None:
    rows = replicas(admin)
    assert len(rows) == 2 and all(r["status"] == "serving" for r in rows)
    for row in rows:
        for rank in ("0", "1"):  # the header pins the engine
            body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0}}
            r = httpx.post(
                f"{row['url']}/inference/v1/generate", json=body, headers={"X-data-parallel-rank": rank}, timeout=60
            )
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["policy_version"] == version, (row["url"], rank)
            if label is not None:
                assert choice["weight_version"] == label
            hf_check(model_dir, PROMPT, choice)


def broadcast_to_every_engine(admin: str, pushed: Path) -> int:
    """A trainer's broadcast push (label "step-7") into the 2 x dp=2 deployment, which counts 4 ranks; every
    engine then serves it. Returns the pushed policy version."""
    assert httpx.get(f"{admin}/get_world_size", timeout=30).json() == {"world_size": 4}
    version = replicas(admin)[0]["policy_version"] + 1
    trainer = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")
    assert trainer_push(admin, pushed, timeout=600, trainer=trainer) == [version]
    every_engine_serves(admin, pushed, version, "step-7")
    return version


def test_a_broadcast_push_reaches_every_engine_of_every_replica(deployment, root):
    _, admin = deployment
    broadcast_to_every_engine(admin, make_model("tiny", root / "pushed", seed=4))


def test_a_vllm_weight_transfer_reaches_every_engine_of_every_replica(deployment, root):
    _, admin = deployment
    pushed = make_model("tiny", root / "pushed-vllm", seed=5)
    version = replicas(admin)[0]["policy_version"] + 1
    plan = [["join"], ["push", str(pushed / "model.safetensors"), {"generate": False}]]
    proc = subprocess.run(
        [sys.executable, VLLM_TRAINER, admin, json.dumps(plan)], capture_output=True, text=True, timeout=600
    )
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["status"] for s in steps] == [200, 200], proc.stderr[-3000:]
    assert steps[1]["finish"][0] == 200, steps[1]
    every_engine_serves(admin, pushed, version, None)
