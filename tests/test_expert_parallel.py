"""Mixture-of-experts models over several ranks on CPU (gloo): tensor parallelism splitting every expert,
expert parallelism spreading whole experts with all-to-all dispatch, and the expert load balancer. Each
matches transformers' forward (greedy ids equal, logprobs as close as one rank's) and reports the same
routed_experts as one rank."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import make_model
from test_engine import assert_matches_hf, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe", seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 1000, lo=5, hi=40, seed=3)


def moe_engine(model_dir, **parallel) -> Engine:
    return Engine(
        Config.model_validate(
            {
                "model": {"name": str(model_dir), "max_model_len": 512},
                "engine": {"kv_cache_bytes": 8 << 20},
                "parallel": parallel,
                "enable_return_routed_experts": True,
            }
        )
    )


def run(model_dir, prompts, params=GREEDY, **parallel):
    engine = moe_engine(model_dir, **parallel)
    try:
        return [o.outputs[0] for o in engine.generate(prompts, params)]
    finally:
        engine.close()


@pytest.fixture(scope="module")
def one_rank(model_dir, prompts):
    return run(model_dir, prompts)


def assert_same_routing(outs, reference):
    for out, ref in zip(outs, reference):
        assert out.routed_experts.dtype == ref.routed_experts.dtype
        np.testing.assert_array_equal(out.routed_experts, ref.routed_experts)


def check(model_dir, hf, prompts, one_rank, **parallel):
    outs = run(model_dir, prompts, **parallel)
    assert_matches_hf(hf, prompts, [_Wrapped(o) for o in outs])
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_rank]
    assert_same_routing(outs, one_rank)
    return outs


class _Wrapped:  # assert_matches_hf reads RequestOutput.outputs[0]
    def __init__(self, completion):
        self.outputs = [completion]


def test_tensor_parallel_splits_every_expert(model_dir, hf, prompts, one_rank):
    check(model_dir, hf, prompts, one_rank, tp=2)


def test_stacked_experts_are_cut_like_the_per_expert_tensors():
    from rlserve.model.tensor_parallel import shard

    e, i, h = 3, 8, 5
    gate_up, down = torch.randn(e, 2 * i, h), torch.randn(e, h, i)
    p = "model.layers.0.mlp.experts."
    for rank in range(2):
        stacked = shard(p + "gate_up_proj", gate_up, rank, 2)
        stacked_down = shard(p + "down_proj", down, rank, 2)
        for x in range(e):
            gate = shard(f"{p}{x}.gate_proj.weight", gate_up[x, :i], rank, 2)
            up = shard(f"{p}{x}.up_proj.weight", gate_up[x, i:], rank, 2)
            assert torch.equal(stacked[x], torch.cat((gate, up)))
            assert torch.equal(stacked_down[x], shard(f"{p}{x}.down_proj.weight", down[x], rank, 2))
        assert torch.equal(shard(p + "gate_up_proj", gate_up, rank, 2, experts_whole=True), gate_up)
