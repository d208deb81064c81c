"""Router replay under prefill/decode disaggregation: a P/D deployment (1 prefill + 1 decode server behind the
real vllm-router) of a tiny Qwen3-MoE with enable_return_routed_experts. Each pulled KV block brings its routed
experts, so the decode server's `routed_experts` cover the prompt P computed and the completion D computed, and
tokens, logprobs and routed experts equal a single server's."""

from __future__ import annotations

import base64
import os

import httpx
import numpy as np
import pytest

from conftest import start_server, stop_server
from deploy_helpers import replicas, start_deployment, stop_deployment, wait_for
from rlserve.model.make import make_model
from test_pd import BLOCK, close, metric, pinned, prompts

KV_BYTES = str(16 << 20)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.fixture(scope="module")
def single(moe_dir):
    # one replica's share of the cores, as in test_pd: reductions split over threads round differently
    threads = str(max(1, (os.cpu_count() or 1) // 2))
    args = ("--engine.kv_cache_bytes", KV_BYTES, "--num_threads", threads)
    url, proc = start_server("--model.name", str(moe_dir), "--enable_return_routed_experts", *args)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def pd(moe_dir):
    public, admin, proc = start_deployment(
        "--deployment.type",
        "disaggregated",
        "--model.name",
        str(moe_dir),
        "--enable_return_routed_experts",
        "--engine.kv_cache_bytes",
        KV_BYTES,
    )
    try:
        p, d = (r["url"] for r in sorted(replicas(admin), key=lambda r: r["index"]))
        yield public, p, d
    finally:
        stop_deployment(proc)


def generate(url: str, prompt: list[int], max_tokens: int = 8) -> dict:
    body = {"token_ids": prompt, "sampling_params": {"max_tokens": max_tokens, "temperature": 0, "logprobs": 0}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def experts(payload: dict) -> np.ndarray:
    raw = base64.b64decode(payload["data"])
    return np.frombuffer(raw, dtype={"uint8": "<u1", "uint16": "<u2"}[payload["dtype"]]).reshape(payload["shape"])


def test_replay_under_pd_equals_a_single_server(pd, single):
    public, p, d = pd
    before = {
        n: metric(d, n) for n in ("rlserve:kv_transfer_tokens_total", "rlserve:kv_transfer_local_fallbacks_total")
    }
    long, short, small, one_block = prompts(21, [75, 100, 12, 40])
    shared = long[: 3 * BLOCK] + prompts(22, [30])[0]  # three full blocks in common with `long`
    for prompt in (long, short, small, one_block, shared):
        # D computes the last partial block against KV it did not compute, as any prefix-cache hit does: the
        # single server answers in the same state (test_pd.warm)
        generate(single, prompt, max_tokens=1)
        got, want = generate(public, prompt), generate(single, prompt)
        assert got["token_ids"] == want["token_ids"]
        assert close(
            [c["logprob"] for c in got["logprobs"]["content"]], [c["logprob"] for c in want["logprobs"]["content"]]
        )
        rows = len(prompt) + len(got["token_ids"]) - 1  # every forwarded position: the prompt's came from P
        assert got["routed_experts"]["start"] == 0 and got["routed_experts"]["shape"] == [rows, 3, 2]
        assert got["routed_experts"]["shape"] == want["routed_experts"]["shape"]
        np.testing.assert_array_equal(experts(got["routed_experts"]), experts(want["routed_experts"]))
    # D pulled every full prompt block it lacked (with its routed experts) and recomputed none
    pulled = sum((len(x) - 1) // BLOCK * BLOCK for x in (long, short, small, one_block, shared)) - 3 * BLOCK
    assert metric(d, "rlserve:kv_transfer_tokens_total") - before["rlserve:kv_transfer_tokens_total"] == pulled
    assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == before["rlserve:kv_transfer_local_fallbacks_total"]
    wait_for(lambda: pinned(p) == 0, 120, "P to free every pinned block")
