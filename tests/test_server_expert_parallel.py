"""A server spreading tiny-moe's experts over two ranks (enable_expert_parallel, enable_eplb): answers as
transformers with transformers' routed experts, shows the expert load in /metrics, rebalances while
serving, and takes disk updates and trainer pushes on every rank (each rank loading the experts it holds)."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from conftest import start_server, stop_server
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port
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


def test_data_parallel_engines_share_their_experts_and_step_together(base):
    """dp = 2 engines of one rank each, the experts spread over both: a request on one engine makes the
    other run dummy steps beside it; both engines' answers are transformers' with its routed experts."""
    import threading

    from transformers import AutoModelForCausalLM

    url, proc = start_server(
        "--model.name", str(base), "--parallel.dp", "2", "--parallel.enable_expert_parallel", "true",
        "--enable_return_routed_experts",
    )  # fmt: skip
    try:
        hf = AutoModelForCausalLM.from_pretrained(base).eval()
        results: dict = {}

        def ask(engine: int, prompt: list[int], max_tokens: int) -> None:
            body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": max_tokens, "logprobs": 0}}
            r = httpx.post(
                f"{url}/inference/v1/generate", json=body, headers={"X-data-parallel-rank": str(engine)}, timeout=300
            )
            assert r.status_code == 200, r.text
            results[(engine, tuple(prompt), max_tokens)] = r.json()["choices"][0]

        ask(0, PROMPTS[0], 8)  # engine 1 idle: it runs dummy steps
        ask(1, PROMPTS[1], 8)
        # both at once, of different lengths: engine 0 finishes first and steps dummies for engine 1
        threads = [threading.Thread(target=ask, args=(e, PROMPTS[2 * e], 4 + 6 * e)) for e in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(results) == 4
        for (_, prompt, _), choice in results.items():
            hf_check(base, list(prompt), choice)
            rows = decode(choice["routed_experts"])
            np.testing.assert_array_equal(rows, hf_experts(hf, (list(prompt) + choice["token_ids"])[:-1]))
    finally:
        stop_server(proc)


def test_vllm_multi_node_launch_lines_make_one_expert_group_over_two_servers(base):
    """vLLM's multi-node data-parallel launch (docs: a head node, then `--data-parallel-start-rank` on the next),
    with one engine per "node" on 127.0.0.1: the two servers form one expert group of two ranks, and each answers
    as transformers, with transformers' routed experts, whichever server the request goes to."""
    group = ("-dp", "2", "-dpl", "1", "-dpa", "127.0.0.1", "-dpp", str(free_port()), "--enable-expert-parallel")
    lines = [group, (*group, "--data-parallel-start-rank", "1")]
    flags = ("--enable-return-routed-experts", "--max-model-len", "512")
    with ThreadPoolExecutor(2) as pool:  # each waits in the group's rendezvous for the other
        started = list(pool.map(lambda line: start_server(*line, *flags, head=(str(base),)), lines))
    try:
        for url, _ in started:
            check_answers(url, base)
            ranks = metric(url, "rlserve:ep_rank_load_total", "ep_rank")
            assert set(ranks) == {"0", "1"} and min(ranks.values()) > 0  # both servers' ranks computed experts
    finally:
        for _, proc in started:
            stop_server(proc)
