"""KV offload tiers (CPU memory, disk) behind the prefix cache, on the tiny model.

The multi-turn workload's cached working set is 4x the KV pool: without offload every turn
recomputes most of its history; with it, a turn computes about its new tokens only.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.config.schema import Config, KVOffloadConfig
from rlserve.engine.engine import Engine
from rlserve.engine.kv import format as kv_format
from rlserve.engine.kv.format import BlockFormatError, KVBlock
from rlserve.engine.params import SamplingParams
from rlserve.engine.weights import stage_from_dir
from rlserve.model.make import make_model
from test_engine import assert_matches_hf

BLOCK = 16
SESSIONS, TURNS, HISTORY, NEW = 8, 3, 64, 32  # final history 160 tokens = 10 blocks a session
POOL_BLOCKS = SESSIONS * (HISTORY + TURNS * NEW) // BLOCK // 4  # a quarter of the working set


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model("tiny", root / "base", seed=0), make_model("tiny", root / "next", seed=1)


def make_engine(model_dir, offload: dict | None = None, pool_blocks: int = POOL_BLOCKS) -> Engine:
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = pool_blocks * BLOCK
    cfg.engine.block_size = BLOCK
    cfg.engine.kv_cache_bytes = pool_blocks * BLOCK * 2048  # the tiny model: 2 KiB of KV a token
    if offload is not None:
        cfg.kv_cache_offload = KVOffloadConfig.model_validate(offload)
    return Engine(cfg)


def conversations(vocab: int) -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(vocab) for _ in range(HISTORY + TURNS * NEW)] for _ in range(SESSIONS)]


def turn_params() -> list[SamplingParams]:
    """Greedy and seeded samples, with logprobs."""
    return [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4, ignore_eos=True, logprobs=2)
        for i in range(SESSIONS)
    ]


def run_turns(engine: Engine, convs: list[list[int]], turns=range(TURNS)) -> tuple[list, list[int]]:
    """Each turn resends every session's history plus NEW tokens; outputs and prompt tokens computed per turn."""
    outs, computed = [], []
    for t in turns:
        before = engine.stats.prompt_tokens_computed
        outs.append(engine.generate([c[: HISTORY + (t + 1) * NEW] for c in convs], turn_params()))
        computed.append(engine.stats.prompt_tokens_computed - before)
    return outs, computed


def assert_same_outputs(a: list, b: list) -> None:
    """Same tokens; logprobs equal to the engine's exactness (a recomputed prefix sums in another order)."""
    for turn_a, turn_b in zip(a, b, strict=True):
        for x, y in zip(turn_a, turn_b, strict=True):
            assert x.outputs[0].token_ids == y.outputs[0].token_ids
            assert x.outputs[0].top_logprobs[0].keys() == y.outputs[0].top_logprobs[0].keys()
            assert torch.allclose(torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs), atol=1e-5)


@pytest.fixture(scope="module")
def baseline(dirs):
    """The workload without offload: what every offload run must reproduce."""
    engine = make_engine(dirs[0])
    convs = conversations(engine.vocab_size)
    outs, computed = run_turns(engine, convs)
    return convs, outs, computed


def test_block_format_round_trip_and_damage():
    kv = torch.randn(3, 2, BLOCK, 2, 8).to(torch.bfloat16)
    experts = torch.randint(0, 64, (BLOCK, 3, 2), dtype=torch.int32)
    block = KVBlock(b"\x01" * 32, kv, weight_generation=4, metadata={"routed_experts": experts})
    data = kv_format.encode(block)
    back = kv_format.decode(data, expect_hash=b"\x01" * 32, expect_shape=tuple(kv.shape), expect_dtype=torch.bfloat16)
    assert torch.equal(back.kv, kv) and torch.equal(back.metadata["routed_experts"], experts)
    assert back.weight_generation == 4 and back.block_hash == block.block_hash
    header = data[12 : 12 + int.from_bytes(data[8:12], "little")]
    assert json.loads(header)["tensors"][0] == {
        "name": "kv",
        "dtype": "bfloat16",
        "shape": [3, 2, BLOCK, 2, 8],
        "offset": 0,
        "nbytes": kv.nbytes,
    }
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    for bad in (data[:-100], bytes(flipped), b"not a block"):
        with pytest.raises(BlockFormatError):
            kv_format.decode(bad)
    with pytest.raises(BlockFormatError, match="different hash"):
        kv_format.decode(data, expect_hash=b"\x02" * 32)
    with pytest.raises(BlockFormatError, match="dtype"):
        kv_format.decode(data, expect_dtype=torch.float32)


def test_config_shape_and_startup_checks(dirs, tmp_path):
    cfg = Config.model_validate(
        {
            "engine": {"enable_prefix_caching": False},
            "kv_cache_offload": {"type": "native", "cpu": {"num_bytes": 1 << 20}},
        }
    )
    assert cfg.engine.enable_prefix_caching  # offload sits behind the prefix cache
    with pytest.raises(ValueError, match="disk tier alone"):
        Config.model_validate({"kv_cache_offload": {"disk": {"path": str(tmp_path)}}})
    with pytest.raises(ValueError, match="cpu.num_bytes"):
        Config.model_validate({"kv_cache_offload": {"type": "native"}})
    a_file = tmp_path / "file"
    a_file.write_text("")
    for path in (tmp_path / "missing", a_file):
        with pytest.raises(ValueError, match="not an existing directory"):
            make_engine(dirs[0], {"cpu": {"num_bytes": 1 << 20}, "disk": {"path": str(path)}})
    with pytest.raises(ValueError, match="holds no KV block"):
        make_engine(dirs[0], {"cpu": {"num_bytes": 1000}})
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            make_engine(dirs[0], {"cpu": {"num_bytes": 1 << 20}, "disk": {"path": str(locked)}})


def test_multi_turn_computes_only_new_tokens_with_identical_outputs(dirs, baseline):
    convs, base_outs, base_computed = baseline
    engine = make_engine(dirs[0], {"cpu": {"num_bytes": 8 << 20}})
    outs, computed = run_turns(engine, convs)
    assert_same_outputs(outs, base_outs)
    # later turns: about the new tokens (plus a block a session at most), far below the no-offload run
    for turn in range(1, TURNS):
        assert computed[turn] <= SESSIONS * (NEW + BLOCK)
        assert base_computed[turn] > 2 * computed[turn]
    s = engine.stats
    assert s.kv_offload_cpu_hits >= (TURNS - 1) * SESSIONS * HISTORY // 2
    assert s.kv_offload_bytes_to_cpu > 0 and s.kv_offload_bytes_from_cpu > 0
    hf = AutoModelForCausalLM.from_pretrained(dirs[0], dtype=torch.float32).eval()
    last = [c[: HISTORY + TURNS * NEW] for c in convs]
    assert_matches_hf(hf, last[1::2], outs[-1][1::2])  # the greedy sessions equal transformers
    engine.close()


def test_blocks_come_back_from_disk_and_corrupt_files_are_recomputed(dirs, baseline, tmp_path):
    convs, base_outs, _ = baseline
    engine = make_engine(dirs[0], {"cpu": {"num_bytes": 4 * BLOCK * 2048}, "disk": {"path": str(tmp_path)}})
    outs, computed = run_turns(engine, convs, range(TURNS - 1))
    assert engine.stats.kv_offload_disk_hits > 0 and engine.stats.kv_offload_bytes_from_disk > 0
    assert computed[-1] <= SESSIONS * (NEW + BLOCK)
    files = sorted(engine.offload.disk.dir.glob("*.kvb"))
    assert files
    for i, f in enumerate(files):  # flip a byte in half of them, truncate the rest
        data = bytearray(f.read_bytes())
        if i % 2:
            data[len(data) // 2] ^= 0xFF
            f.write_bytes(bytes(data))
        else:
            f.write_bytes(bytes(data[: len(data) // 2]))
    last, _ = run_turns(engine, convs, [TURNS - 1])
    assert engine.stats.kv_offload_disk_rejected > 0
    assert_same_outputs(outs + last, base_outs)
    disk_dir = engine.offload.disk.dir
    engine.close()
    assert not disk_dir.exists() and not any(tmp_path.iterdir())


def test_full_disk_stops_disk_writes_and_keeps_serving(dirs, baseline, tmp_path):
    """A file-size limit makes every block write fail as on a full disk (EFBIG), in a child process."""
    convs, base_outs, _ = baseline
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = {sys.path!r}
        from test_kv_offload import make_engine, run_turns
        engine = make_engine({str(dirs[0])!r}, {{"cpu": {{"num_bytes": {4 * BLOCK * 2048}}}, "disk": {{"path": {str(tmp_path)!r}}}}})
        outs, _ = run_turns(engine, json.loads(sys.stdin.read()))
        print(json.dumps([[o.outputs[0].token_ids for o in turn] for turn in outs]))
        print(json.dumps({{"to_disk": engine.stats.kv_offload_bytes_to_disk, "writable": engine.offload.disk.writable}}))
    """)

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

    proc = subprocess.run(
        [sys.executable, "-c", script],
        input=json.dumps(convs),
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        timeout=600,
        cwd=os.path.dirname(__file__),
    )
    assert proc.returncode == 0, proc.stderr
    tokens, stats = (json.loads(line) for line in proc.stdout.strip().splitlines()[-2:])
    assert tokens == [[o.outputs[0].token_ids for o in turn] for turn in base_outs]
    assert stats == {"to_disk": 0, "writable": False}
    assert proc.stderr.count("is full") == 1


def test_no_tier_hit_crosses_a_weight_update(dirs, tmp_path):
    base, nxt = dirs
    engine = make_engine(base, {"cpu": {"num_bytes": 4 * BLOCK * 2048}, "disk": {"path": str(tmp_path)}})
    convs = conversations(engine.vocab_size)
    run_turns(engine, convs, [0, 0])  # the second pass hits the tiers
    assert engine.stats.kv_offload_cpu_hits + engine.stats.kv_offload_disk_hits > 0
    assert any(engine.offload.disk.dir.glob("*.kvb"))
    engine.commit_weights(stage_from_dir(engine.model, nxt))
    assert engine.stats.kv_offload_cpu_used_bytes == 0 and not any(engine.offload.disk.dir.glob("*.kvb"))
    hits = engine.stats.kv_offload_cpu_hits + engine.stats.kv_offload_disk_hits
    prompts = [c[: HISTORY + NEW] for c in convs[:3]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = [engine.generate([p], params)[0] for p in prompts]  # one at a time: nothing can hit its own blocks
    assert engine.stats.kv_offload_cpu_hits + engine.stats.kv_offload_disk_hits == hits
    assert all(o.num_cached_tokens == 0 and o.outputs[0].policy_version == 1 for o in outs)
    assert_matches_hf(AutoModelForCausalLM.from_pretrained(nxt, dtype=torch.float32).eval(), prompts, outs)
    engine.close()


def test_router_replay_hook_carries_block_metadata_or_recomputes(dirs, baseline, tmp_path):
    """Per-block arrays (routed experts, MoE) go through both tiers with the KV; a block without an array
    the engine requires is recomputed."""
    convs, base_outs, _ = baseline
    offload = {"cpu": {"num_bytes": 4 * BLOCK * 2048}, "disk": {"path": str(tmp_path)}}
    engine = make_engine(dirs[0], offload)
    engine.offload.required_metadata = frozenset({"routed_experts"})  # nothing provides it: no tier hit
    outs, _ = run_turns(engine, convs, [0, 0])
    assert engine.stats.kv_offload_cpu_hits == engine.stats.kv_offload_disk_hits == 0
    assert_same_outputs(outs, base_outs[:1] * 2)
    engine.close()

    engine = make_engine(dirs[0], offload)
    saved, restored = set(), []

    def metadata_of(block: int) -> dict[str, torch.Tensor]:
        saved.add(engine.pool.hashes[block])
        return {"routed_experts": torch.tensor(list(engine.pool.hashes[block]), dtype=torch.uint8)}

    engine.offload.required_metadata = frozenset({"routed_experts"})
    engine.offload.metadata_of = metadata_of
    engine.offload.restore_metadata = lambda block, md: restored.append(bytes(md["routed_experts"].tolist()))
    outs, _ = run_turns(engine, convs, [0, 0])
    assert_same_outputs(outs, base_outs[:1] * 2)
    s = engine.stats
    assert s.kv_offload_disk_hits > 0 and len(restored) == (s.kv_offload_cpu_hits + s.kv_offload_disk_hits) // BLOCK
    assert set(restored) <= saved
    engine.close()


def test_serve_with_offload_config_file_metrics_and_sigterm_cleanup(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from conftest import start_server, stop_server

    disk = tmp_path / "kv"
    disk.mkdir()
    config = tmp_path / "offload.toml"
    config.write_text(
        f'[kv_cache_offload]\ntype = "native"\n[kv_cache_offload.cpu]\nnum_bytes = {4 * BLOCK * 2048}\n'
        f'[kv_cache_offload.disk]\npath = "{disk}"\n'
    )
    url, proc = start_server(
        "@", str(config), "--engine.kv_cache_bytes", str(32 * BLOCK * 2048), "--model.max_model_len", "512"
    )
    try:
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        rng = random.Random(5)
        sessions = [[rng.randrange(250) for _ in range(200)] for _ in range(4)]  # 4 x 13 blocks, the pool holds 32
        for _ in range(2):
            for prompt in sessions:
                r = httpx.post(
                    f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}, timeout=120
                )
                assert r.status_code == 200, r.text
        assert any(disk.glob("rlserve-kv-*/*.kvb"))
        text = httpx.get(f"{url}/metrics", timeout=30).text
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

        def value(name: str, **labels: str) -> float:
            return sum(v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls))

        assert (
            value("rlserve:kv_offload_hits_total", tier="cpu") + value("rlserve:kv_offload_hits_total", tier="disk") > 0
        )
        assert value("rlserve:kv_offload_queries_total", tier="cpu") > 0
        assert value("rlserve:kv_offload_bytes_total", direction="pool_to_cpu") > 0
        assert value("rlserve:kv_offload_bytes_total", direction="cpu_to_disk") > 0
        assert value("rlserve:kv_offload_capacity_bytes", tier="cpu") == 4 * BLOCK * 2048
        assert value("rlserve:kv_offload_usage_bytes", tier="disk") > 0
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        stop_server(proc)
    assert not any(disk.iterdir())  # SIGTERM removed the disk tier's files and folder


def test_router_replay_reports_the_experts_of_blocks_loaded_from_the_tiers(tmp_path):
    from test_moe import assert_routing_matches

    model_dir = make_model("tiny-moe", tmp_path / "moe")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), 128
    cfg.engine.kv_cache_bytes = 8 * BLOCK * 2048  # 8 blocks: each prompt (4 full blocks) evicts the one before
    cfg.enable_return_routed_experts = True
    cfg.kv_cache_offload = KVOffloadConfig.model_validate(
        {"cpu": {"num_bytes": 2 * BLOCK * 2048}, "disk": {"path": str(tmp_path)}}
    )
    engine = Engine(cfg)
    prompts = [c[:70] for c in conversations(engine.vocab_size)[:4]]
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    for _ in range(2):
        outs = [engine.generate([p], params)[0] for p in prompts]
    assert engine.stats.kv_offload_disk_hits > 0  # the experts came back through block files
    for prompt, out in zip(prompts, outs):
        assert_routing_matches(hf, prompt, out.outputs[0])
    engine.close()
