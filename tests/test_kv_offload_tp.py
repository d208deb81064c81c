"""KV offload under tensor parallelism (parallel.tp = 2, real worker processes on CPU over gloo).

Each rank keeps its slice of every block in tiers of its own; rank 0 decides every move and the worker replays
it. The multi-turn workload's working set is 4x the pool, so later turns load their history back from the
tiers: the tokens and logprobs equal one rank's with the same tiers, with the same tier hits.
"""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import make_model
from test_kv_offload import assert_same_outputs  # tokens equal, logprobs to the engine's exactness

BLOCK = 16
SESSIONS, TURNS, HISTORY, NEW = 6, 3, 64, 32  # final history 160 tokens = 10 blocks a session
POOL_BLOCKS = SESSIONS * (HISTORY + TURNS * NEW) // BLOCK // 4  # a quarter of the working set
BLOCK_BYTES = BLOCK * 2048  # the tiny model: 2 KiB of KV a token (over all ranks)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("models") / "base", seed=0)


def make_engine(model_dir, tp: int, offload: dict, pool_blocks: int = POOL_BLOCKS, **extra) -> Engine:
    return Engine(
        Config.model_validate(
            {
                "model": {"name": str(model_dir), "max_model_len": pool_blocks * BLOCK},
                "engine": {"block_size": BLOCK, "kv_cache_bytes": pool_blocks * BLOCK_BYTES},
                "parallel": {"tp": tp},
                "kv_cache_offload": offload,
                **extra,
            }
        )
    )


def run_turns(engine: Engine, convs: list[list[int]]) -> tuple[list, list[int]]:
    """Each turn resends every session's history plus NEW tokens (greedy, with logprobs); the outputs and the
    prompt tokens computed per turn."""
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=2)
    outs, computed = [], []
    for t in range(TURNS):
        before = engine.stats.prompt_tokens_computed
        outs.append(engine.generate([c[: HISTORY + (t + 1) * NEW] for c in convs], params))
        computed.append(engine.stats.prompt_tokens_computed - before)
    return outs, computed


def run(model_dir, tp: int, offload: dict, inspect=None) -> tuple[list, list[int], dict]:
    engine = make_engine(model_dir, tp, offload)
    try:
        rng = random.Random(3)
        convs = [[rng.randrange(engine.vocab_size) for _ in range(HISTORY + TURNS * NEW)] for _ in range(SESSIONS)]
        outs, computed = run_turns(engine, convs)
        if inspect is not None:
            inspect(engine)
        return outs, computed, asdict(engine.stats)
    finally:
        engine.close()


def hits(stats: dict) -> tuple[int, int]:
    return stats["kv_offload_cpu_hits"], stats["kv_offload_disk_hits"]


def test_cpu_tier_under_two_ranks_matches_one_rank(model_dir):
    offload = {"cpu": {"num_bytes": 8 << 20}}
    one_outs, one_computed, one = run(model_dir, 1, offload)
    two_outs, two_computed, two = run(model_dir, 2, offload)
    assert_same_outputs(two_outs, one_outs)
    # the same blocks came back from the tier (rank 0 decides alike): later turns compute about their new tokens
    assert two_computed == one_computed
    assert hits(two) == hits(one) and two["kv_offload_cpu_hits"] >= (TURNS - 1) * SESSIONS * HISTORY // 2
    for turn in range(1, TURNS):
        assert two_computed[turn] <= SESSIONS * (NEW + BLOCK)
    # cpu.num_bytes is the total over the ranks (as vLLM's kv_offloading_size): rank 0 holds half of each block
    assert two["kv_offload_cpu_capacity_bytes"] == one["kv_offload_cpu_capacity_bytes"] // 2


def test_disk_tier_under_two_ranks_matches_one_rank_with_a_directory_a_rank(model_dir, tmp_path):
    one_dir, two_dir = tmp_path / "one", tmp_path / "two"
    one_dir.mkdir(), two_dir.mkdir()
    seen: dict[str, set[str]] = {}

    def rank_files(engine: Engine) -> None:
        for d in two_dir.iterdir():
            seen[d.name.split("-")[2]] = {f.name for f in d.glob("*.kvb")}

    cpu = {"num_bytes": 4 * BLOCK_BYTES}  # 4 blocks: most of the history spills to disk
    one_outs, _, one = run(model_dir, 1, {"cpu": cpu, "disk": {"path": str(one_dir)}})
    two_outs, _, two = run(model_dir, 2, {"cpu": cpu, "disk": {"path": str(two_dir)}}, rank_files)
    assert_same_outputs(two_outs, one_outs)
    assert hits(two) == hits(one) and two["kv_offload_disk_hits"] >= (TURNS - 1) * SESSIONS * HISTORY // 2
    # every rank has its own directory, holding its slice of the same blocks under the same keys
    assert set(seen) == {"rank0", "rank1"} and seen["rank0"] == seen["rank1"] and seen["rank0"]
    assert not any(two_dir.iterdir())  # closing the engine removed every rank's directory


def test_router_replay_reports_experts_of_blocks_loaded_under_two_ranks(tmp_path):
    from test_moe import assert_routing_matches

    moe_dir = make_model("tiny-moe", tmp_path / "moe")
    hf = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    offload = {"cpu": {"num_bytes": 2 * BLOCK_BYTES}, "disk": {"path": str(tmp_path)}}
    # 8 blocks: each prompt (4 full blocks) evicts the one before
    engine = make_engine(moe_dir, 2, offload, pool_blocks=8, enable_return_routed_experts=True)
    try:
        rng = random.Random(4)
        prompts = [[rng.randrange(engine.vocab_size) for _ in range(70)] for _ in range(4)]
        params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        for _ in range(2):
            outs = [engine.generate([p], params)[0] for p in prompts]
        assert engine.stats.kv_offload_disk_hits > 0  # the experts came back through rank 0's block files
        for prompt, out in zip(prompts, outs):
            assert_routing_matches(hf, prompt, out.outputs[0])
    finally:
        engine.close()


def test_server_with_two_ranks_loads_prefixes_from_every_rank_tier_like_one_rank(model_dir, tmp_path):
    """A tp=2 server (config file, HTTP, SIGTERM): the second round's prompts come back from the tiers and
    answer as one rank with the same tiers; SIGTERM removes every rank's disk directory."""
    import signal

    import httpx

    from conftest import start_server, stop_server
    from test_server_rl import choice_lps, generate

    disk = tmp_path / "kv"
    disk.mkdir()
    offload = {"cpu": {"num_bytes": 4 * BLOCK_BYTES}, "disk": {"path": str(disk)}}
    config = tmp_path / "offload.toml"
    config.write_text(
        f'[kv_cache_offload]\ntype = "native"\n[kv_cache_offload.cpu]\nnum_bytes = {4 * BLOCK_BYTES}\n'
        f'[kv_cache_offload.disk]\npath = "{disk}"\n'
    )
    rng = random.Random(5)
    sessions = [[rng.randrange(250) for _ in range(200)] for _ in range(4)]  # 4 x 13 blocks, the pool holds 32
    url, proc = start_server(
        "@",
        str(config),
        "--model.name",
        str(model_dir),
        "--parallel.tp",
        "2",
        "--engine.kv_cache_bytes",
        str(32 * BLOCK_BYTES),
    )
    try:
        served = [generate(url, prompt, max_tokens=4)["choices"][0] for _ in range(2) for prompt in sessions]
        assert len(list(disk.iterdir())) == 2  # rank 0's directory and rank 1's
        text = httpx.get(f"{url}/metrics", timeout=30).text
        tier_hits = sum(
            float(line.split()[-1]) for line in text.splitlines() if line.startswith("rlserve:kv_offload_hits_total{")
        )
        assert tier_hits >= len(sessions) * 8 * BLOCK  # most of each second-round prompt came from the tiers
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        stop_server(proc)
    assert not any(disk.iterdir())  # SIGTERM removed every rank's files and folder

    engine = make_engine(model_dir, 1, offload | {"disk": {"path": str(tmp_path)}}, pool_blocks=32)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=0)
        local = [engine.generate([prompt], params)[0].outputs[0] for _ in range(2) for prompt in sessions]
        assert engine.stats.kv_offload_disk_hits + engine.stats.kv_offload_cpu_hits == tier_hits
    finally:
        engine.close()
    for choice, one in zip(served, local, strict=True):
        assert choice["token_ids"] == one.token_ids
        assert torch.allclose(torch.tensor(choice_lps(choice)), torch.tensor(one.logprobs), atol=1e-5)


def test_a_worker_missing_its_copy_of_a_disk_block_fails_the_engine_loudly(model_dir, tmp_path, capfd):
    """Rank 0 counts a disk block as loaded before the step; a worker whose own file is gone cannot compute its
    slice, so the engine fails (as with a dead rank) rather than answer from wrong KV."""
    engine = make_engine(model_dir, 2, {"cpu": {"num_bytes": 4 * BLOCK_BYTES}, "disk": {"path": str(tmp_path)}})
    try:
        rng = random.Random(3)
        convs = [[rng.randrange(engine.vocab_size) for _ in range(HISTORY + NEW)] for _ in range(SESSIONS)]
        params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        engine.generate(convs, params)
        (rank1,) = tmp_path.glob("rlserve-kv-rank1-*")
        for f in rank1.glob("*.kvb"):
            f.unlink()
        with pytest.raises(RuntimeError) as info:
            engine.generate(convs, params)
        assert engine.tp.explain(info.value).startswith("tensor-parallel rank 1")
        assert "missing or damaged in this rank's disk tier" in capfd.readouterr().err  # the worker says why
    finally:
        engine.close()
