"""Batch invariance across prefill/decode disaggregation: with `engine.batch_invariant` on, a P/D deployment
(1 prefill + 1 decode server behind the real vllm-router) returns the tokens and logprobs of a single server
bit for bit, although D decodes over KV that P computed, in other batches, in another process. Unlike the
default mode's P/D test, the single server answers cold (no warm-up to put it in D's prefix-cache state)
and the P/D requests run concurrently.

Logprobs are float32 values; they are compared as float32, bit for bit. In P/D mode the router re-parses the
JSON it passes on, and a value can come back one float64 ulp away from the float32 the server sent (seen
here: -0.17661058902740479 sent, -0.1766105890274048 received), which rounds back to the same float32."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from conftest import start_server, stop_server
from deploy_helpers import replicas, start_deployment, stop_deployment, wait_for
from test_pd import BLOCK, completion, metric, pinned, prompts

INVARIANT = ("--engine.batch_invariant", "true", "--engine.kv_cache_bytes", str(16 << 20))


@pytest.fixture(scope="module")
def single():
    url, proc = start_server(*INVARIANT)
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def pd():
    public, admin, proc = start_deployment("--deployment.type", "disaggregated", *INVARIANT)
    try:
        p, d = (r["url"] for r in sorted(replicas(admin), key=lambda r: r["index"]))
        yield public, p, d
    finally:
        stop_deployment(proc)


def test_pd_outputs_equal_a_single_server_bitwise(pd, single):
    public, p, d = pd
    cases = prompts(31, [70, 100, 40, 12, 90])
    cases.append(cases[0][: 2 * BLOCK] + prompts(32, [25])[0])  # two full blocks in common with the first
    sampling = [{"temperature": 0}, {"temperature": 1.0, "seed": 7}, {"temperature": 0.8, "top_p": 0.9, "seed": 3}]
    calls = [(prompt, s) for prompt in cases for s in sampling[: 1 + len(prompt) % 3]]
    pulled = metric(d, "rlserve:kv_transfer_tokens_total")
    with ThreadPoolExecutor(len(calls)) as pool:
        got = list(pool.map(lambda c: completion(public, c[0], **c[1])["choices"][0], calls))
    for (prompt, s), choice in zip(calls, got):
        want = completion(single, prompt, **s)["choices"][0]
        assert choice["token_ids"] == want["token_ids"], (len(prompt), s)
        got_lp, want_lp = (np.float32(c["logprobs"]["token_logprobs"]) for c in (choice, want))
        assert got_lp.tobytes() == want_lp.tobytes(), (len(prompt), s, got_lp - want_lp)
    assert metric(d, "rlserve:kv_transfer_tokens_total") > pulled  # D decoded over KV that P computed
    assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == 0
    wait_for(lambda: pinned(p) == 0, 120, "P to free every pinned block")
