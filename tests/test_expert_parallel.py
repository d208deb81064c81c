"""Mixture-of-experts models over several ranks on CPU (gloo): tensor parallelism splitting every expert,
expert parallelism spreading whole experts with all-to-all dispatch, and the expert load balancer. Each
matches transformers' forward (greedy ids equal, logprobs as close as one rank's) and reports the same
routed_experts as one rank."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from forked_servers import child_processes
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.expert_parallel import ExpertParallelMoe, expert_layers, expert_stats
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port
from test_engine import assert_matches_hf, random_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe", seed=0)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(4, 1000, lo=5, hi=40, seed=3)


def moe_engine(model_dir, engine: dict | None = None, model: dict | None = None, **parallel) -> Engine:
    return Engine(
        Config.model_validate(
            {
                "model": {"name": str(model_dir), "max_model_len": 512, **(model or {})},
                "engine": {"kv_cache_bytes": 8 << 20, **(engine or {})},
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


def check(model_dir, hf, fp64, prompts, one_rank, stats=None, **parallel):
    outs = run(model_dir, prompts, stats=stats, **parallel)
    assert_matches_hf(hf, prompts, [_Wrapped(o) for o in outs])
    assert [o.token_ids for o in outs] == [o.token_ids for o in one_rank]
    assert_within_fp32_error(outs, fp64)
    assert_same_routing(outs, one_rank)
    return outs


@pytest.fixture(scope="module")
def fp64(model_dir, hf, prompts, one_rank) -> tuple[list[torch.Tensor], float]:
    """(transformers' float64 forward's logprobs of one rank's tokens, the largest distance of its float32 forward
    from them, at one torch thread and at two). The float32 distance is the precision any float32 implementation
    can be held to, and transformers' own moves with the order its threads sum in: on tiny-moe 1.5e-5 at one
    thread, 1.7e-5 at two, above the issue's 1e-5. rlserve's answers do not move with threads: 2.8e-5 at tp=1,
    3.0e-5 at tp=2, 3.2e-5 under EP from float64 (AVX2 machine). Earlier modules of a pytest worker may leave
    torch at either count, so both are taken."""
    from transformers import AutoModelForCausalLM

    # eager experts: grouped_mm has no float64 kernel
    fp64 = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64, experts_implementation="eager").eval()
    exact = [_token_logprobs(fp64, prompt, ref.token_ids) for prompt, ref in zip(prompts, one_rank)]
    error, threads = 0.0, torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for prompt, ref, want in zip(prompts, one_rank, exact):
                error = max(error, (_token_logprobs(hf, prompt, ref.token_ids) - want).abs().max().item())
    finally:
        torch.set_num_threads(threads)
    return exact, error


def _token_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The completion's logprobs in float64, from the model's logits in its own dtype."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(completion).unsqueeze(1)).squeeze(1)


def assert_within_fp32_error(outs, reference) -> None:
    """Each logprob within twice transformers' own float32 error of the float64 forward."""
    exact, error = reference
    worst = max((torch.tensor(o.logprobs, dtype=torch.float64) - e).abs().max().item() for o, e in zip(outs, exact))
    assert worst <= 2 * error, f"{worst:.2e} from the float64 forward; transformers' float32: {error:.2e}"


class _Wrapped:  # assert_matches_hf reads RequestOutput.outputs[0]
    def __init__(self, completion):
        self.outputs = [completion]


def test_one_rank_is_as_close_to_the_float64_forward_as_transformers_float32(fp64, one_rank):
    assert_within_fp32_error(one_rank, fp64)


def test_tensor_parallel_splits_every_expert(model_dir, hf, fp64, prompts, one_rank):
    check(model_dir, hf, fp64, prompts, one_rank, tp=2)


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


def test_expert_parallel_over_two_ranks_dispatches_with_all_to_all(model_dir, hf, fp64, prompts, one_rank):
    stats: dict = {}
    check(model_dir, hf, fp64, prompts, one_rank, stats, tp=2, enable_expert_parallel=True)
    layer = stats["layer"]
    assert isinstance(layer, ExpertParallelMoe) and layer.gate_up_proj.shape[0] == 4  # 8 experts, 4 a rank
    assert layer.local_slots.tolist() == [0, 1, 2, 3]
    assert stats["ep_all_to_all_seconds"] > 0
    # every assignment of every forwarded token counted once, on the rank holding its expert
    forwarded = sum(len(p) + GREEDY.max_tokens - 1 for p in prompts)
    assert sum(stats["ep_rank_load"]) == sum(stats["ep_expert_load"]) == forwarded * 3 * 2  # 3 sparse layers, top-2
    assert min(stats["ep_rank_load"]) > 0


def test_dual_batch_overlap_keeps_every_token_and_routing(model_dir, hf, fp64, prompts, one_rank):
    """enable_dbo: each sparse layer runs two micro-batches with their all-to-alls interleaved (twice the
    collectives, three per micro-batch); tokens and routed experts stay those of one rank and transformers."""
    plain, overlapped = {}, {}
    check(model_dir, hf, fp64, prompts, one_rank, plain, tp=2, enable_expert_parallel=True)
    check(model_dir, hf, fp64, prompts, one_rank, overlapped, tp=2, enable_expert_parallel=True, enable_dbo=True)
    assert overlapped["layer"].dbo and not plain["layer"].dbo
    assert overlapped["ep_all_to_alls"] == 2 * plain["ep_all_to_alls"] > 0
    assert overlapped["ep_rank_load"] == plain["ep_rank_load"]


def dp_engine(rank: int, model_dir: str, prompt: list[int], results, model: dict | None = None, **parallel) -> None:
    """One data-parallel engine of an expert-parallel group spanning several engines (a process)."""
    engine = Engine(
        Config.model_validate(
            {
                "model": {"name": model_dir, "max_model_len": 512, **(model or {})},
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
    (every engine steps as often as the others here: one prompt each, the same number of tokens). Each gives
    one rank's tokens, routed experts (see assert_routing_as_one_ranks) and logprobs to 1e-5."""
    for rank, token_ids, logprobs, routed in dp_engines_answers(model_dir, prompts, tp, dp):
        ref = one_rank[rank]
        assert token_ids == ref.token_ids
        assert_routing_as_one_ranks(routed, ref.routed_experts, tp)
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(ref.logprobs), atol=1e-5)
    assert_matches_hf(hf, prompts[:dp], [_Wrapped(one_rank[r]) for r in range(dp)])


def dp_engines_answers(model_dir, prompts, tp: int, dp: int, model: dict | None = None) -> list[tuple]:
    """(rank, token ids, logprobs, routed experts) of dp engine processes of tp ranks, one expert group, engine r
    serving prompts[r]; each engine's rank 0 is checked to hold its share of the experts."""
    ctx = child_processes()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(
            target=dp_engine,
            args=(r, str(model_dir), prompts[r]),
            kwargs={"results": results, "model": model, "tp": tp, "dp": dp, "data_parallel_rpc_port": port},
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
    e = json.loads((model_dir / "config.json").read_text())["num_experts"]
    for rank, *_, slots in got:
        assert slots == list(range(rank * e // dp, rank * e // dp + e // (tp * dp)))  # rank 0 of each engine
    return [answer[:-1] for answer in got]


def assert_routing_as_one_ranks(routed, want, tp: int) -> None:
    """Routed experts (tokens x layers x top-k, each token's choices best first) equal one rank's. Under tensor
    parallelism a layer's input is summed over the ranks in another order, and that can swap a near-tie for a
    token's last choice (seen once in 1,920 choices, on an AVX-512 machine); any other difference fails."""
    routed, want = np.asarray(routed), np.asarray(want)
    if tp == 1:
        np.testing.assert_array_equal(routed, want)
        return
    differ = routed != want
    assert not differ[..., :-1].any(), "a choice other than a token's last differs from one rank's"
    assert differ.sum() <= max(1, differ.size // 500), f"{differ.sum()} of {differ.size} last choices differ"


def test_prime_rl_and_vllm_spellings_turn_expert_parallelism_on(tmp_path):
    from pathlib import Path

    from rlserve.config.load import ConfigError, load_config
    from test_launch_configs import launch

    docs = Path(__file__).parent / "fixtures" / "prime_rl_docs"
    single = load_config(["@", str(docs / "03_single_node_ep.toml")])
    assert single.parallel.enable_expert_parallel and (single.parallel.tp, single.parallel.dp) == (2, 4)
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
    with pytest.raises(ConfigError, match="enable_dbo overlaps expert parallelism"):
        path.write_text("[inference]\nenable_dbo = true\n")
        load_config(["@", str(path)])
    path.write_text("[inference]\nenable_expert_parallel = true\nenable_dbo = true\n")
    assert load_config(["@", str(path)]).parallel.enable_dbo
    assert launch("-ep", "--enable-dbo").parallel.enable_dbo


def test_expert_parallelism_needs_a_mixture_of_experts_model_and_even_experts(model_dir, tmp_path):
    with pytest.raises(ValueError, match="this one is dense"):
        Engine(Config.model_validate({"parallel": {"enable_expert_parallel": True}}))
    with pytest.raises(ValueError, match=r"experts \(8\) plus the redundant experts \(1\) to divide evenly"):
        moe_engine(model_dir, tp=2, enable_expert_parallel=True, enable_eplb=True, eplb_num_redundant_experts=1)


def rank0_heavy_tokens(hf, count: int) -> list[int]:
    """Tokens whose repeats send the largest share of assignments to rank 0 of two under the initial
    placement of 8 experts + 2 redundant (rank 0: experts 0-4; rank 1: 5-7 and copies of 0, 1)."""
    ids = torch.arange(300).unsqueeze(1).repeat(1, 30)
    with torch.no_grad():
        routers = hf(ids, output_router_logits=True).router_logits
    experts = torch.stack([r.float().topk(2, -1).indices for r in routers], 1).view(300, -1)
    share = torch.tensor([0.5, 0.5, 1, 1, 1, 0, 0, 0])[experts].mean(1)
    return share.argsort(descending=True)[:count].tolist()


def test_eplb_rebalance_lowers_the_busiest_rank_and_changes_no_token(model_dir, hf):
    """A skewed workload (tokens whose repeats route mostly to rank 0's experts) run twice; the balancer
    re-places and replicates the hot experts between the runs. The second run's busiest rank carries
    less, and both runs give the same tokens, logprobs and (logical) routed experts as transformers."""
    from rlserve.model.eplb import busiest_share

    skewed = [[t] * n for t, n in zip(rank0_heavy_tokens(hf, 4), (40, 35, 30, 45))]
    steps = GREEDY.max_tokens  # forwards of one run: a prefill, then a decode per further token
    engine = moe_engine(
        model_dir,
        engine={"enable_prefix_caching": False},  # the second run computes every token again
        tp=2,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb_step_interval=steps + 1,  # rebalance as the second run starts
        eplb_num_redundant_experts=2,
    )
    try:
        layers = expert_layers(engine.model)
        first = [o.outputs[0] for o in engine.generate(skewed, GREEDY)]
        before = sum(m.rank_load for m in layers)
        assert [m.rebalances for m in layers] == [0, 0, 0]
        initial = [m.local_slots.tolist() for m in layers]
        second = [o.outputs[0] for o in engine.generate(skewed, GREEDY)]
        after = sum(m.rank_load for m in layers) - before
        assert [m.rebalances for m in layers] == [1, 1, 1]
        assert [m.local_slots.tolist() for m in layers] != initial
        # measured on this workload: 0.84 of all assignments on one rank before, 0.56 after
        assert busiest_share(before) > 0.75 and busiest_share(after) < 0.6
        stats = engine.stats
    finally:
        engine.close()
    assert stats.eplb_rebalances == 1
    for a, b in zip(first, second):
        assert a.token_ids == b.token_ids
        np.testing.assert_array_equal(a.routed_experts, b.routed_experts)
        assert int(a.routed_experts.max()) < 8  # logical ids, never the 10 physical slots
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    assert_matches_hf(hf, skewed, [_Wrapped(c) for c in second])


def test_a_rebalanced_engine_writes_every_expert_once_from_both_ranks(model_dir, hf):
    """What a deployment keeps after a push (runtime/weight_snapshot.py) from one engine of two expert-parallel
    ranks, after the balancer re-placed and replicated experts: rank 0 gathers rank 1's slots and writes each
    expert once, from its first replica, equal to the checkpoint bit for bit."""
    from safetensors.torch import load_file

    from rlserve.runtime.weight_snapshot import checkpoint_tensors, part_file

    skewed = [[t] * n for t, n in zip(rank0_heavy_tokens(hf, 2), (40, 35))]
    engine = moe_engine(
        model_dir, tp=2, enable_expert_parallel=True, enable_eplb=True, eplb_step_interval=4,
        eplb_num_redundant_experts=2,
    )  # fmt: skip
    try:
        engine.generate(skewed, GREEDY)
        layers = expert_layers(engine.model)
        assert min(m.rebalances for m in layers) >= 1
        assert any(m.placement.slots.tolist() != [0, 1, 2, 3, 4, 5, 6, 7, 0, 1] for m in layers)
        got = checkpoint_tensors(engine.model, engine.tp, call_id=1)
        assert part_file(engine.model) == "model.safetensors"  # one engine: the whole checkpoint
    finally:
        engine.close()
    want = load_file(model_dir / "model.safetensors")
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def dp_engine_part(rank: int, model_dir: str, port: int, results) -> None:
    """One of two data-parallel engines of two ranks each: its part of the checkpoint (a process)."""
    from safetensors.torch import save

    from rlserve.runtime.weight_snapshot import checkpoint_tensors, part_file

    parallel = {"enable_expert_parallel": True, "data_parallel_rank": rank, "tp": 2, "dp": 2}
    engine = moe_engine(model_dir, **parallel, data_parallel_rpc_port=port)
    try:
        # as safetensors bytes: a queued tensor shares its storage by a descriptor this process must outlive
        part = save(checkpoint_tensors(engine.model, engine.tp, call_id=1))
        results.put((rank, part_file(engine.model), part))
    finally:
        engine.close()


def test_each_data_parallel_engine_writes_its_part_gathered_from_its_ranks(model_dir):
    """tp = 2 ranks in each of dp = 2 engines, one expert group of four: each engine's rank 0 gathers its worker's
    experts; engine 0's part holds every other tensor, and the two parts hold each tensor once, bit for bit."""
    from safetensors.torch import load, load_file

    ctx = child_processes()
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=dp_engine_part, args=(r, str(model_dir), port, results)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        (_, first_file, first), (_, second_file, second) = sorted(results.get(timeout=600) for _ in procs)
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    assert (first_file, second_file) == ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    first, second = load(first), load(second)
    want = load_file(model_dir / "model.safetensors")
    assert not set(first) & set(second) and set(first) | set(second) == set(want)
    assert {name.split(".experts.")[1].split(".")[0] for name in second} == {"4", "5", "6", "7"}  # ranks 2 and 3
    for name, tensor in want.items():
        got = first.get(name, second.get(name))
        assert got.dtype == tensor.dtype and torch.equal(got, tensor), name


def test_eplb_plan_replicates_the_hot_expert_and_moves_only_what_changes():
    from rlserve.model.eplb import Placement, rebalanced, transfers

    old = Placement.initial(8, 2, redundant=2)
    assert old.slots.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0, 1]
    load = torch.tensor([1, 1, 100, 50, 1, 1, 1, 1])
    new = rebalanced(old, load)
    assert sorted(new.slots.tolist()) == sorted([0, 1, 2, 2, 3, 3, 4, 5, 6, 7])  # both spares to the hot ones
    for rank in range(2):  # a rank holds an expert once, and the replicas of 2 and of 3 sit on both ranks
        local = new.local(rank).tolist()
        assert len(set(local)) == 5 and {2, 3} <= set(local)
    kept = [(p, e) for p, e in enumerate(new.slots.tolist()) if old.slots[p] == e]
    moves = transfers(old, new)
    assert len(moves) == 10 - len(kept)
    for dst, slot, src, src_slot in moves:
        assert old.slots[src * 5 + src_slot] == new.slots[dst * 5 + slot]
    # a replicated expert's tokens alternate between its replicas
    experts, tokens = torch.tensor([2, 2, 2, 2, 7]), torch.arange(5)
    physical = new.physical(experts, tokens)
    assert set(physical[:4].tolist()) == set(torch.nonzero(new.slots == 2).view(-1).tolist())
    assert new.slots[physical].tolist() == experts.tolist()
