"""Prefill/decode KV transfer under tensor parallelism (parallel.tp = 2, real worker processes on CPU over gloo),
in process: real prefill and decode engines with their block server and puller, as tests/test_kv_transfer.py.

The wire carries whole blocks (every KV head) whatever either side's tp, so a tp=2 prefill engine pairs with a
tp=2 or a tp=1 decode engine and the other way round. Each pull leaves every decode rank with its heads' slice
of the prefill side's blocks, byte for byte, and the decode engine answers as it does when it computed the
prompt itself; under router replay the routed experts of the prompt come with the blocks."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import make_model
from test_kv_transfer import run, settle

BLOCK = 16


def make_engine(model_dir, tp: int, **extra) -> Engine:
    return Engine(
        Config.model_validate(
            {
                "model": {"name": str(model_dir), "max_model_len": 256},
                "engine": {"block_size": BLOCK, "kv_cache_bytes": 4 << 20},
                "parallel": {"tp": tp},
                "kv_transfer": {"pin_timeout_s": 30.0},
                **extra,
            }
        )
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0)


@pytest.fixture(scope="module")
def engines(model_dir):
    made = {}
    try:
        for name, tp in (("p2", 2), ("d2", 2), ("p1", 1), ("d1", 1)):
            made[name] = make_engine(model_dir, tp)
        yield made
    finally:
        for e in made.values():
            e.close()


def prefill(p: Engine, prompt: list[int]) -> dict:
    return run(
        p, prompt=prompt, params=SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    ).kv_transfer_params


GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=1, ignore_eos=True)


def local(d: Engine, prompt: list[int]):
    """D's own answer in the state a pull leaves it: its full prompt blocks cached, the last partial block
    computed against them (a cold prefill of the whole prompt sums in another order)."""
    d.pool.reset_prefix_cache()
    run(d, prompt=prompt, params=SamplingParams(max_tokens=1))
    return run(d, prompt=prompt, params=GREEDY).outputs[0]


def pulled(p: Engine, d: Engine, prompt: list[int]):
    kt = prefill(p, prompt)
    d.pool.reset_prefix_cache()  # cold: every full block is pulled
    before = (d.kv_transfer.stats.tokens_in, d.stats.prompt_tokens_computed, d.kv_transfer.stats.fallbacks)
    out = run(d, prompt=prompt, params=dataclasses.replace(GREEDY, kv_transfer_params=kt)).outputs[0]
    full = (len(prompt) - 1) // BLOCK * BLOCK
    assert d.kv_transfer.stats.tokens_in - before[0] == full
    assert d.stats.prompt_tokens_computed - before[1] == len(prompt) - full  # only the last partial block
    assert d.kv_transfer.stats.fallbacks == before[2]
    settle(p, lambda: p.kv_transfer.pinned_blocks == 0, "P to unpin after the pull")
    return kt, out


def same(got, want) -> None:
    assert got.token_ids == want.token_ids
    assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(want.logprobs), atol=1e-5)


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts per case: nothing is cached from an earlier one
    return [[rng.randrange(10, 500) for _ in range(n)] for n in lengths]


def whole_blocks(e: Engine, prompt: list[int]) -> torch.Tensor:
    """Every rank's slices of the prompt's cached full blocks, put together (rank 0 alone at tp=1)."""
    req = e.make_request("probe", prompt)
    hashes = e.kv_transfer._hashes(req, (len(prompt) - 1) // BLOCK)
    blocks = [e.pool.lookup(h) for h in hashes]
    assert None not in blocks
    if e.kv_transfer.ranks is not None:
        return e.kv_transfer.ranks.gather(blocks)
    return torch.stack([e.runner.kv_cache[:, :, b * BLOCK : (b + 1) * BLOCK] for b in blocks])


@pytest.mark.parametrize(
    "pair, seed", [(("p2", "d2"), 1), (("p2", "d1"), 2), (("p1", "d2"), 3)], ids=["tp2-tp2", "tp2-tp1", "tp1-tp2"]
)
def test_a_pull_between_any_tp_answers_as_the_decode_engine_itself(engines, pair, seed):
    p, d = (engines[name] for name in pair)
    for prompt in prompts(seed, [40, 75, 130]):
        want = local(d, prompt)
        kt, got = pulled(p, d, prompt)
        assert kt["kv_shape"][3] == d.kv_transfer.block_shape[3]  # whole blocks on the wire, whatever the tp
        same(got, want)
        # every decode rank holds its heads of the prefill side's blocks, as computed there
        assert torch.equal(whole_blocks(d, prompt), whole_blocks(p, prompt))
    assert p.pool.num_free == p.pool.num_blocks


def test_the_wire_block_is_the_whole_block_at_every_tp(engines):
    (prompt,) = prompts(5, [50])
    shapes = {name: prefill(engines[name], prompt)["kv_shape"] for name in ("p2", "p1")}
    assert shapes["p2"] == shapes["p1"]
    for name in ("p2", "p1"):
        engines[name].abort("r")  # frees the pin
        settle(engines[name], lambda e=engines[name]: e.kv_transfer.pinned_blocks == 0, "the pin to be freed")


def test_router_replay_under_two_ranks_each_side(tmp_path):
    moe_dir = make_model("tiny-moe", tmp_path / "moe", seed=0)
    p = make_engine(moe_dir, 2, enable_return_routed_experts=True)
    try:
        d = make_engine(moe_dir, 2, enable_return_routed_experts=True)
        try:
            for prompt in prompts(11, [40, 75]):
                want = local(d, prompt)
                _, got = pulled(p, d, prompt)
                same(got, want)
                assert got.routed_experts.shape == (len(prompt) + len(got.token_ids) - 1, 3, 2)
                np.testing.assert_array_equal(got.routed_experts, want.routed_experts)
        finally:
            d.close()
    finally:
        p.close()


def test_a_disaggregated_deployment_of_two_rank_servers_answers_as_one_two_rank_server(tmp_path):
    """`deployment.type = "disaggregated"` with parallel.tp = 2 on both servers, behind the real vllm-router:
    tokens, logprobs and router replay's routed experts equal one tp=2 server's, and D computes only each
    prompt's last partial block."""
    from conftest import start_server, stop_server
    from deploy_helpers import replicas, start_deployment, stop_deployment, wait_for
    from test_pd import close, metric, pinned
    from test_pd_replay import experts, generate

    moe_dir = make_model("tiny-moe", tmp_path / "moe", seed=0)
    # one torch thread per rank everywhere: reductions split over threads round differently
    common = (
        "--model.name",
        str(moe_dir),
        "--parallel.tp",
        "2",
        "--num_threads",
        "1",
        "--enable_return_routed_experts",
    )
    url, single = start_server(*common)
    try:
        public, admin, proc = start_deployment("--deployment.type", "disaggregated", *common)
        try:
            p, d = (r["url"] for r in sorted(replicas(admin), key=lambda r: r["index"]))
            before = {
                n: metric(d, n) for n in ("rlserve:kv_transfer_tokens_total", "rlserve:prompt_tokens_computed_total")
            }
            lengths = [40, 75, 130]
            for prompt in prompts(31, lengths):
                generate(url, prompt, max_tokens=1)  # the state D answers in (local())
                got, want = generate(public, prompt), generate(url, prompt)
                assert got["token_ids"] == want["token_ids"]
                lps = [[c["logprob"] for c in x["logprobs"]["content"]] for x in (got, want)]
                assert close(*lps)
                assert got["routed_experts"]["shape"] == [len(prompt) + len(got["token_ids"]) - 1, 3, 2]
                np.testing.assert_array_equal(experts(got["routed_experts"]), experts(want["routed_experts"]))
            full = sum((n - 1) // BLOCK * BLOCK for n in lengths)
            assert metric(d, "rlserve:kv_transfer_tokens_total") - before["rlserve:kv_transfer_tokens_total"] == full
            computed = (
                metric(d, "rlserve:prompt_tokens_computed_total") - before["rlserve:prompt_tokens_computed_total"]
            )
            assert computed == sum(lengths) - full
            assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == 0
            wait_for(lambda: pinned(p) == 0, 120, "P to free every pinned block")
        finally:
            stop_deployment(proc)
    finally:
        stop_server(single)
