"""A server spreading tiny-moe's experts over two ranks (enable_expert_parallel, enable_eplb): answers as
transformers with transformers' routed experts, shows the expert load in /metrics, rebalances while
serving, and takes disk updates and trainer pushes on every rank (each rank loading the experts it holds)."""

from __future__ import annotations

import json
import re

import httpx
import numpy as np
import pytest

from conftest import start_server, stop_server
from rlserve.model.make import make_model
from test_moe import hf_experts
from test_server_moe import decode
from test_server_rl import ADMIN, PROMPTS, generate, hf_check, trainer_push


@pytest.fixture(scope="module")
def base(root):
    return make_model("tiny-moe", root / "base", seed=0)


@pytest.fixture(scope="module")
def ep_server(root, base):
    url, proc = start_server(
        "--model.name", str(base), "--weight_roots", json.dumps([str(root)]), "--server.admin_api_key", "admin",
        "--parallel.tp", "2", "--parallel.enable_expert_parallel", "true", "--parallel.enable_eplb", "true",
        "--parallel.eplb_step_interval", "4", "--parallel.eplb_num_redundant_experts", "2",
        "--enable_return_routed_experts",
    )  # fmt: skip
    try:
        yield url
    finally:
        stop_server(proc)


def metric(url: str, name: str, label: str | None = None) -> dict[str, float]:
    """{value of `label` (or ""): value} of one metric family."""
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        m = re.match(rf"{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m:
            key = re.search(rf'{label}="([^"]*)"', m.group(1)).group(1) if label else ""
            out[key] = float(m.group(2))
    return out


def check_answers(url, model_dir):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    for prompt in PROMPTS:
        choice = generate(url, prompt, max_tokens=8)["choices"][0]
        hf_check(model_dir, prompt, choice)
        rows = decode(choice["routed_experts"])
        np.testing.assert_array_equal(rows, hf_experts(hf, (prompt + choice["token_ids"])[:-1]))


def test_answers_routing_and_load_metrics_through_rebalances(ep_server, base):
    check_answers(ep_server, base)
    ranks = metric(ep_server, "rlserve:ep_rank_load_total", "ep_rank")
    assert set(ranks) == {"0", "1"} and min(ranks.values()) > 0
    experts = metric(ep_server, "rlserve:ep_expert_load_total", "expert")
    assert len(experts) == 8 and sum(experts.values()) == sum(ranks.values())  # logical experts only
    assert metric(ep_server, "rlserve:eplb_rebalances_total")[""] >= 1  # every 4 steps: many by now
    assert 0.5 <= metric(ep_server, "rlserve:ep_busiest_rank_share")[""] <= 1
    assert metric(ep_server, "rlserve:ep_all_to_all_seconds_total")[""] > 0


def test_disk_update_and_trainer_push_reach_every_ranks_experts(ep_server, root, base):
    new = make_model("tiny-moe", root / "step-1", seed=1)
    r = httpx.post(f"{ep_server}/update_weights", json={"weight_dir": str(new)}, headers=ADMIN, timeout=120)
    assert r.status_code == 200, r.text
    check_answers(ep_server, new)
    pushed = make_model("tiny-moe", root / "pushed", seed=2)
    trainer_push(ep_server, pushed, timeout=300)
    check_answers(ep_server, pushed)
