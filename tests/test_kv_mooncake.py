"""kv_cache_offload.type = "mooncake": KV blocks in one Mooncake store (the real mooncake_master on 127.0.0.1)
shared by several engines, as by the replicas of a deployment (tensor-parallel ones included).

Engine A computes a prompt and evicts it (its pool is too small to keep it past the fillers that follow);
engine B, which never saw the prompt, then serves it from the store: it computes one block of it, and its
outputs are those of an engine without the store. No block crosses a weight update, and a store whose
master dies turns offload off and leaves the outputs as they were.
"""

from __future__ import annotations

import logging
import random
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch

from rlserve.config.schema import Config, KVOffloadConfig
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.engine.weights import stage_from_dir
from rlserve.model.make import make_model

BLOCK = 16
POOL_BLOCKS = 24
PROMPT_TOKENS = 8 * BLOCK + 5  # 8 full blocks, a partial one
TAIL = PROMPT_TOKENS - 8 * BLOCK  # what is computed of a prompt whose full blocks are cached


def _mooncake_or_skip() -> None:
    from rlserve.deploy.mooncake import find_binary
    from rlserve.engine.kv.mooncake import MooncakeUnavailable, import_store

    try:
        import_store()
        find_binary()
    except (MooncakeUnavailable, RuntimeError) as e:
        pytest.skip(f"the Mooncake store cannot run here: {e}")


@pytest.fixture(scope="module")
def master():
    _mooncake_or_skip()
    from rlserve.deploy.mooncake import MooncakeMaster

    m = MooncakeMaster()
    yield m
    m.stop()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model("tiny", root / "base", seed=0), make_model("tiny", root / "next", seed=1)


def make_engine(model_dir, master=None, tp: int = 1) -> Engine:
    cfg = Config()
    cfg.parallel.tp = tp
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = POOL_BLOCKS * BLOCK
    cfg.engine.block_size = BLOCK
    cfg.engine.kv_cache_bytes = POOL_BLOCKS * BLOCK * 2048  # the tiny model: 2 KiB of KV a token
    cfg.engine.enable_prefix_caching = True
    if master is not None:
        cfg.kv_cache_offload = KVOffloadConfig.model_validate(
            {
                "type": "mooncake",
                "cpu": {"num_bytes": 16 << 20},
                "mooncake": {"master_address": master.master_address, "metadata_server": master.metadata_server},
            }
        )
    return Engine(cfg)


def prompts(seed: int, n: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(250) for _ in range(length)] for _ in range(n)]


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2),
    SamplingParams(temperature=0.9, seed=7, max_tokens=6, ignore_eos=True, logprobs=2),
]


def serve(engine: Engine, prompt: list[int]) -> tuple[list, int]:
    """The outputs of PARAMS on `prompt` (one request each, one after the other) and the prompt tokens computed."""
    before = engine.stats.prompt_tokens_computed
    outs = [engine.generate([prompt], p)[0] for p in PARAMS]
    return outs, engine.stats.prompt_tokens_computed - before


def evict_everything(engine: Engine, seed: int) -> None:
    """Fillers that take every pool block, so each cached block is handed out again (and saved to the store)."""
    for p in prompts(seed, 3, (POOL_BLOCKS - 2) * BLOCK):
        engine.generate([p], SamplingParams(max_tokens=1))


def assert_same(a: list, b: list) -> None:
    """Same tokens; logprobs equal to the engine's exactness (a recomputed prefix sums in another order)."""
    for x, y in zip(a, b, strict=True):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert [t.keys() for t in x.outputs[0].top_logprobs] == [t.keys() for t in y.outputs[0].top_logprobs]
        assert torch.allclose(torch.tensor(x.outputs[0].logprobs), torch.tensor(y.outputs[0].logprobs), atol=1e-5)


def test_replica_b_serves_the_prefix_replica_a_computed(dirs, master):
    reference = make_engine(dirs[0])
    a, b = make_engine(dirs[0], master), make_engine(dirs[0], master)
    try:
        prompt = prompts(1, 1)[0]
        want, computed_alone = serve(reference, prompt)
        assert computed_alone == PROMPT_TOKENS + TAIL  # the second request hits the pool
        got_a, _ = serve(a, prompt)
        evict_everything(a, seed=2)
        assert a.stats.kv_offload_bytes_to_mooncake > 0
        got_b, computed_b = serve(b, prompt)
        # B loads the 8 full blocks and computes the partial one: 5 tokens of 133 (then hits its pool)
        assert computed_b == 2 * TAIL
        assert b.stats.kv_offload_mooncake_hits == 8 * BLOCK
        assert b.stats.kv_offload_mooncake_rejected == 0
        assert_same(got_a, want)
        assert_same(got_b, want)
    finally:
        for e in (reference, a, b):
            e.close()


@pytest.mark.parametrize("tp_a, tp_b", [(2, 2), (1, 2)], ids=["tp2-tp2", "tp1-tp2"])
def test_two_rank_replicas_reuse_prefixes_from_the_store(dirs, master, tp_a, tp_b):
    """Under tensor parallelism the store keeps whole blocks (every rank's heads): a tp=2 replica loads a prefix
    that a tp=2 or tp=1 replica computed, into each of its ranks, and answers as a tp=2 engine without the store."""
    reference = make_engine(dirs[0], tp=2)
    a, b = make_engine(dirs[0], master, tp=tp_a), make_engine(dirs[0], master, tp=tp_b)
    try:
        prompt = prompts(30 + tp_a, 1)[0]
        want, _ = serve(reference, prompt)
        serve(a, prompt)
        evict_everything(a, seed=32)
        got, computed = serve(b, prompt)
        assert computed == 2 * TAIL  # the 8 full blocks came from the store
        assert b.stats.kv_offload_mooncake_hits == 8 * BLOCK and b.stats.kv_offload_mooncake_rejected == 0
        assert_same(got, want)
    finally:
        for e in (reference, a, b):
            e.close()


def test_no_block_crosses_a_weight_update(dirs, master):
    base, nxt = dirs
    a, b = make_engine(base, master), make_engine(base, master)
    reference = make_engine(nxt)
    try:
        prompt = prompts(3, 1)[0]
        serve(a, prompt)
        evict_everything(a, seed=4)  # the prompt's blocks are in the store, under the base weights
        b.commit_weights(stage_from_dir(b.model, nxt), "v1")
        got_b, computed_b = serve(b, prompt)
        assert b.stats.kv_offload_mooncake_queries > 0 and b.stats.kv_offload_mooncake_hits == 0
        assert computed_b == PROMPT_TOKENS + TAIL
        want, _ = serve(reference, prompt)
        assert_same(got_b, want)
        # once A has the same new weights, its blocks are B's again
        a.commit_weights(stage_from_dir(a.model, nxt), "v1")
        other = prompts(5, 1)[0]
        serve(a, other)
        evict_everything(a, seed=6)
        got, computed = serve(b, other)
        assert computed == 2 * TAIL
        assert_same(got, serve(reference, other)[0])
    finally:
        for e in (a, b, reference):
            e.close()


def test_master_killed_serving_continues_without_offload(dirs, caplog):
    _mooncake_or_skip()
    from rlserve.deploy.mooncake import MooncakeMaster

    master = MooncakeMaster()
    a, b = make_engine(dirs[0], master), make_engine(dirs[0], master)
    reference = make_engine(dirs[0])
    try:
        prompt = prompts(7, 1)[0]
        serve(a, prompt)
        evict_everything(a, seed=8)
        master.proc.kill()
        master.proc.wait()
        with caplog.at_level(logging.WARNING, logger="rlserve.engine.kv.mooncake"):
            got, computed = serve(b, prompt)
            assert computed == PROMPT_TOKENS + TAIL
            assert not b.offload.enabled
            assert any("Mooncake store is off" in r.getMessage() for r in caplog.records)
        assert_same(got, serve(reference, prompt)[0])
        evict_everything(b, seed=9)  # saves are skipped now, quietly
        assert_same(serve(b, prompt)[0], serve(reference, prompt)[0])
    finally:
        for e in (a, b, reference):
            e.close()
        master.stop()


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("tp", [1, 2])
def test_serve_starts_its_master_and_sigterm_stops_it(tmp_path, tp):
    """A server (tp=2: with its worker rank) starts its master, reuses a prefix from the store, and SIGTERM stops
    the master too."""
    _mooncake_or_skip()
    from conftest import start_server, stop_server

    config = tmp_path / "mooncake.toml"
    config.write_text('[kv_cache_offload]\ntype = "mooncake"\n[kv_cache_offload.cpu]\nnum_bytes = 32_000_000\n')
    url, proc = start_server(
        "@",
        str(config),
        "--engine.kv_cache_bytes",
        str(32 * BLOCK * 2048),
        "--model.max_model_len",
        "256",
        "--engine.block_size",
        str(BLOCK),
        "--parallel.tp",
        str(tp),
    )
    try:
        masters = [p for p in _children(proc.pid) if "mooncake_master" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(masters) == 1
        model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
        prompt = prompts(11, 1, 100)[0]
        for p in [prompt, *prompts(12, 3, 200), prompt]:  # the fillers evict the prompt into the store
            r = httpx.post(f"{url}/v1/completions", json={"model": model, "prompt": p, "max_tokens": 2}, timeout=120)
            assert r.status_code == 200, r.text
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(f"{url}/metrics", timeout=30).text
        hits = [
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "rlserve:kv_offload_hits_total" and s.labels.get("tier") == "mooncake"
        ]
        assert sum(hits) == 6 * BLOCK  # the prompt's 6 full blocks came back from the store
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        stop_server(proc)
    assert code == 0
    deadline = time.monotonic() + 30
    while _alive(masters[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(masters[0]), "the Mooncake master outlived its server"


def _metric(url: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    )


def test_deployment_replicas_share_one_master_and_reuse_each_others_prefixes(tmp_path):
    """The supervisor starts one master for both replicas; replica 1 serves a prompt replica 0 computed,
    computing its last partial block only, with the same tokens; SIGTERM leaves no process."""
    _mooncake_or_skip()
    from deploy_helpers import alive, descendants, replicas, start_deployment, stop_deployment, wait_for

    config = tmp_path / "mooncake.toml"
    config.write_text('[kv_cache_offload]\ntype = "mooncake"\n[kv_cache_offload.cpu]\nnum_bytes = 32_000_000\n')
    _, admin, proc = start_deployment(
        "--deployment.replicas",
        "2",
        "@",
        str(config),
        "--engine.kv_cache_bytes",
        str(32 * BLOCK * 2048),
        "--model.max_model_len",
        "256",
        "--engine.block_size",
        str(BLOCK),
    )
    try:
        tree = descendants(proc.pid)
        masters = [p for p in tree if "mooncake_master" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(masters) == 1
        urls = [r["url"] for r in replicas(admin)]
        model = httpx.get(f"{urls[0]}/v1/models", timeout=30).json()["data"][0]["id"]

        def complete(url: str, prompt: list[int]) -> dict:
            r = httpx.post(
                f"{url}/v1/completions",
                json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "logprobs": 1},
                timeout=120,
            )
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        prompt = prompts(21, 1, 6 * BLOCK + 4)[0]
        first = complete(urls[0], prompt)
        for filler in prompts(22, 3, 200):  # evict the prompt from replica 0's pool into the store
            complete(urls[0], filler)
        before = _metric(urls[1], "rlserve:prompt_tokens_computed_total")
        second = complete(urls[1], prompt)
        assert _metric(urls[1], "rlserve:prompt_tokens_computed_total") - before == 4  # of 100 prompt tokens
        assert _metric(urls[1], "rlserve:kv_offload_hits_total", tier="mooncake") == 6 * BLOCK
        assert second["text"] == first["text"]
        assert second["logprobs"]["tokens"] == first["logprobs"]["tokens"]
    finally:
        stop_deployment(proc)
    wait_for(lambda: not any(alive(pid) for pid in tree), 30, "every child to exit")


def test_config_errors_name_what_to_change(dirs, master):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="set type = 'mooncake'"):
        KVOffloadConfig.model_validate({"cpu": {"num_bytes": 1 << 30}, "mooncake": {"master_address": "h:1"}})
    with pytest.raises(ValidationError, match="metadata_server needs master_address"):
        KVOffloadConfig.model_validate(
            {"type": "mooncake", "cpu": {"num_bytes": 1 << 30}, "mooncake": {"metadata_server": "http://h:2/metadata"}}
        )
    cfg = Config()
    cfg.model.name = str(dirs[0])
    cfg.model.max_model_len = 64
    cfg.engine.kv_cache_bytes = 8 * BLOCK * 2048
    cfg.kv_cache_offload = KVOffloadConfig.model_validate({"type": "mooncake", "cpu": {"num_bytes": 1 << 20}})
    with pytest.raises(ValueError, match="no store address"):
        Engine(cfg)
    cfg.kv_cache_offload = KVOffloadConfig.model_validate(
        {"type": "mooncake", "cpu": {"num_bytes": 1 << 20}, "mooncake": {"master_address": master.master_address}}
    )
    with pytest.raises(ValueError, match="16 MiB"):
        Engine(cfg)


LEASE_S = 10  # the master's default_kv_lease_ttl: a block's memory is not evicted sooner after its put or get


def test_blocks_the_store_evicts_from_memory_are_read_back_from_its_disk(dirs, tmp_path):
    """With kv_cache_offload.disk the master rlserve starts keeps every block under disk.path as well: once the
    store's memory has evicted a prompt's blocks (their only replica is the disk one), another replica still
    loads all of them, computing only the partial block, with the outputs of an engine without the store."""
    _mooncake_or_skip()
    from rlserve.config.schema import KVOffloadDiskConfig
    from rlserve.deploy.mooncake import MooncakeMaster
    from rlserve.engine.kv.pool import block_hash

    master = MooncakeMaster(disk=KVOffloadDiskConfig(path=str(tmp_path)))
    fs_dir = Path(master.fs_dir)
    reference, a, b = make_engine(dirs[0]), make_engine(dirs[0], master), None
    try:
        prompt = prompts(40, 1)[0]
        want, _ = serve(reference, prompt)
        serve(a, prompt)
        evict_everything(a, seed=41)
        req = a.make_request("keys", prompt)
        parent, keys = None, []
        for i in range(8):  # the prompt's full blocks, as the store names them
            parent = block_hash(parent, prompt[i * BLOCK : (i + 1) * BLOCK], a._cache_key(req))
            keys.append(a.offload.key(parent))

        def in_memory() -> int:  # reading a block's replicas counts as a use: the store then keeps it longer
            return sum(any(r.is_memory_replica() for r in a.offload.store.get_replica_desc(k)) for k in keys)

        # other blocks, until the store's memory (16 MiB) has turned over twice since the lease of the prompt's
        # blocks ended; the deadline is a hang guard, not a speed bar
        deadline, seed, kept = time.monotonic() + 600, 42, 8
        while kept:
            assert time.monotonic() < deadline, f"the store kept {kept} of the prompt's 8 blocks in memory"
            since, start = a.stats.kv_offload_bytes_to_mooncake, time.monotonic()
            while a.stats.kv_offload_bytes_to_mooncake - since < 2 * (16 << 20) or time.monotonic() - start < LEASE_S:
                evict_everything(a, seed=seed)
                seed += 1
            kept = in_memory()
        assert a.offload.enabled and len([p for p in fs_dir.rglob("*") if p.is_file()]) >= 8
        b = make_engine(dirs[0], master)
        got, computed = serve(b, prompt)
        assert computed == 2 * TAIL
        assert b.stats.kv_offload_mooncake_hits == 8 * BLOCK and b.stats.kv_offload_mooncake_rejected == 0
        assert_same(got, want)
    finally:
        for e in (reference, a, b):
            if e is not None:
                e.close()
        master.stop()
    assert not fs_dir.exists()  # stopping the master removed its directory
