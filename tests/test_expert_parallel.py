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
from rlserve.model.expert_parallel import ExpertParallelMoe, expert_stats
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


def run(model_dir, prompts, params=GREEDY, stats: dict | None = None, **parallel):
    engine = moe_engine(model_dir, **parallel)
    try:
        outs = [o.outputs[0] for o in engine.generate(prompts, params)]
        if stats is not None:
            stats.update(expert_stats(engine.model), layer=engine.model.layers[0].mlp)
        return outs
    finally:
        engine.close()


@pytest.fixture(scope="module")
def one_rank(model_dir, prompts):
    return run(model_dir, prompts)


def assert_same_routing(outs, reference):
    for out, ref in zip(outs, reference):
        assert out.routed_experts.dtype == ref.routed_experts.dtype
        np.testing.assert_array_equal(out.routed_experts, ref.routed_experts)


def check(model_dir, hf, prompts, one_rank, stats=None, **parallel):
    outs = run(model_dir, prompts, stats=stats, **parallel)
    assert_matches_hf(hf, prompts, [_Wrapped(o) for o in outs])
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_rank]
    assert_same_routing(outs, one_rank)
    return outs


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def test_expert_parallel_over_two_ranks_dispatches_with_all_to_all(model_dir, hf, prompts, one_rank):
    stats: dict = {}
    check(model_dir, hf, prompts, one_rank, stats, tp=2, enable_expert_parallel=True)
    layer = stats["layer"]
    assert isinstance(layer, ExpertParallelMoe) and layer.gate_up_proj.shape[0] == 4  # 8 experts, 4 a rank
    assert layer.local_slots.tolist() == [0, 1, 2, 3]
    assert stats["ep_all_to_all_seconds"] > 0
    # every assignment of every forwarded token counted once, on the rank holding its expert
    forwarded = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    assert sum(stats["ep_rank_load"]) == sum(stats["ep_expert_load"]) == forwarded * 3 * 2  # 3 sparse layers, top-2
    assert min(stats["ep_rank_load"]) > 0


def dp_engine(rank: int, model_dir: str, prompt: list[int], results, **parallel) -> None:
    """One data-parallel engine of an expert-parallel group spanning several engines (a process)."""
    engine = Engine(
        Config.model_validate(
            {
                "model": {"name": model_dir, "max_model_len": 512},
                "engine": {"kv_cache_bytes": 8 << 20},
                "parallel": {"enable_expert_parallel": True, "data_parallel_rank": rank, **parallel},
                "enable_return_routed_experts": True,
                "num_threads": 1,
            }
        )
    )
    try:
        (out,) = engine.generate([prompt], GREEDY)
        comp = out.outputs[0]
        mlp = engine.model.layers[0].mlp
        results.put((rank, comp.token_ids, comp.logprobs, comp.routed_experts, mlp.local_slots.tolist()))
    finally:
        engine.close()


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2)])
def test_expert_parallel_over_four_ranks_of_data_parallel_engines(model_dir, hf, prompts, one_rank, tp, dp):
    """Each engine serves its own prompt; their sparse layers exchange tokens over all tp * dp ranks
    (every engine steps as often as the others here: one prompt each, the same number of tokens)."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=dp_engine,
            args=(r, str(model_dir), prompts[r]),
            kwargs={"results": results, "tp": tp, "dp": dp, "data_parallel_rpc_port": port},
        )
        for r in range(dp)
    ]
    for p in procs:
        p.start()
    try:
        got = sorted(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for rank, token_ids, logprobs, routed, slots in got:
        assert slots == list(range(rank * 8 // dp, rank * 8 // dp + 8 // (tp * dp)))  # rank 0 of each engine
        ref = one_rank[rank]
        assert token_ids == ref.token_ids
        np.testing.assert_array_equal(routed, ref.routed_experts)
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    assert_matches_hf(hf, prompts[:dp], [_Wrapped(one_rank[r]) for r in range(dp)])


def test_prime_rl_and_vllm_spellings_turn_expert_parallelism_on(tmp_path):
    from pathlib import Path

    from rlserve.config.load import ConfigError, load_config
    from rlserve.runtime.data_parallel import check_parallel
    from test_launch_configs import launch

    docs = Path(__file__).parent / "fixtures" / "prime_rl_docs"
    single = load_config(["@", str(docs / "03_single_node_ep.toml")])
    assert single.parallel.enable_expert_parallel and (single.parallel.tp, single.parallel.dp) == (2, 4)
    # the docs' tp = 2, dp = 4: the dp engines' lock-step is not served yet, and the refusal says what to set
    with pytest.raises(ValueError, match="set parallel.dp=1 and spread the experts with parallel.tp"):
        check_parallel(single)
    assert load_config(["@", str(docs / "05_wide_ep.toml")]).parallel.enable_expert_parallel
    path = tmp_path / "rl.toml"
    path.write_text("[inference]\nenable_expert_parallel = true\nenable_eplb = true\n")
    p = load_config(["@", str(path)]).parallel
    assert p.enable_expert_parallel and p.enable_eplb
    for argv in (["--enable-expert-parallel"], ["-ep"]):
        assert launch(*argv).parallel.enable_expert_parallel
    assert launch("-ep", "--enable-eplb").parallel.enable_eplb
    with pytest.raises(ConfigError, match="enable_expert_parallel = true"):
        launch("--enable-eplb")
    with pytest.raises(ConfigError, match="enable_dbo"):
        path.write_text("[inference]\nenable_dbo = true\n")
        load_config(["@", str(path)])


def test_expert_parallelism_needs_a_mixture_of_experts_model_and_even_experts(model_dir, tmp_path):
    with pytest.raises(ValueError, match="this one is dense"):
        Engine(Config.model_validate({"parallel": {"enable_expert_parallel": True}}))
    with pytest.raises(ValueError, match=r"experts \(8\) plus the redundant experts \(1\) to divide evenly"):
        moe_engine(model_dir, tp=2, enable_expert_parallel=True, enable_eplb=True, eplb_num_redundant_experts=1)
