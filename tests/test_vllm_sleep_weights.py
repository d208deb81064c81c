"""vLLM's sleep level 2 on CPU: /sleep?level=2 returns the weights' memory (and the KV cache's) to the OS,
requests are refused (503) until the weights are restored, and after /wake_up plus a restore (reload_weights,
or a trainer's weight update between the two wake-ups) greedy tokens and logprobs are what they were.
Level 1 keeps the weights resident.

The model is wide (a 8192-wide MLP on a 256-wide residual) so its weights, ~110 MB in fp32, dominate every
resident-memory delta; the thresholds are generous fractions of that size, never timings."""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
import psutil
import pytest
from safetensors import safe_open

from conftest import assert_documented_error, make_variant, start_server, stop_server
from rlserve.model.make import make_model

KV_BYTES = 64 << 20
WIDE = {"hidden_size": 256, "head_dim": 64, "intermediate_size": 8192}


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    return make_variant("tiny", tmp_path_factory.mktemp("models") / "sleep-wide", **WIDE)


def weight_bytes(model_dir: Path) -> int:
    total = 0
    for file in model_dir.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += 4 * math.prod(shape)  # fp32
    return total


def greedy(url: str) -> dict:
    body = {
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    }
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]}


def refused(url: str) -> str:
    """A generation while the weights are not there: a 503 that says why, never tokens."""
    body = {"prompt": "hello", "max_tokens": 4}
    streamed = httpx.post(f"{url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 503, streamed.text
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
    assert r.status_code == 503, r.text
    return r.json()["error"]["message"]


def test_sleep_level_2_releases_the_weights_and_a_restore_brings_the_same_outputs(wide_model: Path):
    weights = weight_bytes(wide_model)
    assert weights > 100e6  # the construction the thresholds rely on
    url, proc = start_server(
        "--model.name",
        str(wide_model),
        "--weight_roots",
        json.dumps([str(wide_model.parent)]),
        defaults=("--engine.kv_cache_bytes", str(KV_BYTES), "--model.max_model_len", "512"),
        timeout=600,
    )
    try:
        (engine,) = psutil.Process(proc.pid).children()

        def rss() -> int:
            return engine.memory_info().rss

        before = greedy(url)

        # level 1: the KV cache goes, the weights stay
        awake = rss()
        assert httpx.post(f"{url}/sleep", params={"level": "1"}, timeout=60).status_code == 200
        assert awake - rss() < KV_BYTES + weights * 0.5
        assert httpx.post(f"{url}/wake_up", timeout=60).json()["status"] == "awake"
        assert greedy(url) == before

        # level 2: the weights go too; restored by reload_weights (the served checkpoint)
        awake = rss()
        assert httpx.post(f"{url}/sleep", params={"level": "2"}, timeout=60).status_code == 200
        asleep = rss()
        assert awake - asleep > KV_BYTES * 0.8 + weights * 0.8
        assert "/sleep level 2" in refused(url)
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=120)
        assert r.status_code == 409 and "wake_up" in r.json()["error"]["message"], r.text
        assert httpx.post(f"{url}/wake_up", timeout=60).json() == {"status": "awake", "tags": None}
        assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
        assert "not restored" in refused(url)  # awake, but the weights' contents are undefined
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=300)
        assert r.status_code == 200, r.text
        assert rss() - asleep > KV_BYTES * 0.8 + weights * 0.8
        assert greedy(url) == before

        # a trainer's flow: sleep 2, wake the weights, push them, wake the KV cache. The push resends the
        # directory of the last update, which must load again rather than be taken for a retry.
        push = {"weight_dir": str(wide_model)}
        assert httpx.post(f"{url}/update_weights", json=push, timeout=300).status_code == 200
        assert httpx.post(f"{url}/sleep", params={"level": "2"}, timeout=60).status_code == 200
        r = httpx.post(f"{url}/wake_up", params={"tags": "weights"}, timeout=60)
        assert r.json() == {"status": "sleeping", "tags": ["weights"]}
        assert httpx.post(f"{url}/update_weights", json=push, timeout=300).status_code == 200
        r = httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"}, timeout=60)
        assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
        assert greedy(url) == before
    finally:
        stop_server(proc)


def test_sleep_level_2_fans_out_to_data_parallel_engines():
    """Each engine releases its weights; reload_weights restores every one (a request to each engine by rank)."""
    url, proc = start_server("--parallel.dp", "2")
    try:
        ranks = [{"X-data-parallel-rank": str(rank)} for rank in range(2)]

        def outputs(expect: int = 200) -> list:
            body = {"prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "logprobs": 1}
            rs = [httpx.post(f"{url}/v1/completions", json=body, headers=h, timeout=120) for h in ranks]
            assert {r.status_code for r in rs} == {expect}, [r.text for r in rs]
            return [r.json()["choices"][0]["logprobs"] for r in rs] if expect == 200 else []

        before = outputs()
        assert httpx.post(f"{url}/sleep", params={"level": "2"}, timeout=60).status_code == 200
        outputs(503)
        assert httpx.post(f"{url}/wake_up", timeout=60).json()["status"] == "awake"
        outputs(503)
        r = httpx.post(f"{url}/collective_rpc", json={"method": "reload_weights"}, timeout=300)
        assert r.json() == {"results": [None, None]}
        assert outputs() == before
    finally:
        stop_server(proc)


def test_released_weights_count_as_restored_only_once_every_tensor_is_written(tmp_path):
    """model/release.py on a real MoE model: release empties every parameter and packed copy; after
    allocation a partial update leaves the model unready; per-expert and stacked expert tensors both count."""
    import torch
    from transformers import AutoConfig

    from rlserve.engine.weights import commit, stage
    from rlserve.model.loader import load_model, read_safetensors, safetensors_files
    from rlserve.model.release import allocate_weights, check_writable, release_weights, weights_unready
    from rlserve.model.shape import ModelShape

    model_dir = make_model("tiny-moe", tmp_path / "moe")
    model = load_model(model_dir, ModelShape.from_hf(AutoConfig.from_pretrained(model_dir)), torch.float32, "cpu")
    model.pack_weights()
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    tensors = {n: t.clone() for n, t in read_safetensors(safetensors_files(model_dir))}

    assert release_weights(model) == sum(t.numel() * 4 for t in original.values())
    assert all(p.numel() == 0 for p in model.parameters())
    packed = [m.packed for m in model.modules() if getattr(m, "packed", None) is not None]
    assert packed and all(p._packed is None for p in packed)
    assert "/sleep level 2" in weights_unready(model)
    with pytest.raises(RuntimeError, match="wake_up"):
        check_writable(model)

    allocate_weights(model)
    layer0 = "model.layers.0.mlp.experts."
    per_expert = {n: t for n, t in tensors.items() if not n.startswith(layer0)}
    commit(model, stage(model, per_expert.items(), "test", require_all=False))
    assert f"{layer0}0." in weights_unready(model)  # layer 0's experts are still missing
    experts = range(8)
    stacked = {
        layer0 + "gate_up_proj": torch.stack(
            [
                torch.cat((tensors[f"{layer0}{e}.gate_proj.weight"], tensors[f"{layer0}{e}.up_proj.weight"]))
                for e in experts
            ]
        ),
        layer0 + "down_proj": torch.stack([tensors[f"{layer0}{e}.down_proj.weight"] for e in experts]),
    }
    commit(model, stage(model, stacked.items(), "test", require_all=False))
    assert weights_unready(model) is None
    assert all(torch.equal(p, original[n]) for n, p in model.named_parameters())
    assert all(p._packed is not None for p in packed)  # repacked from the restored weights


# the rows of docs/errors.md's control-plane table that the first test above asserts
DOCUMENTED = [
    ("weights-released", "/v1/completions", 503, "/sleep level 2"),
    ("weights-not-restored", "/v1/completions", 503, "not restored"),
    ("restore-while-released", "/collective_rpc", 409, "wake_up"),
]


@pytest.mark.parametrize("row", DOCUMENTED, ids=[r[0] for r in DOCUMENTED])
def test_sleep_level_2_refusals_are_documented(row):
    assert_documented_error(*row)


def test_trainer_push_restores_the_weights_after_sleep_level_2(tmp_path):
    """vLLM's colocated flow through the weight-transfer routes (TRL's calls, tests/vllm_trainer.py): sleep 2,
    wake the weights, push them, wake the KV cache; greedy output is what the same weights gave before."""
    from test_vllm_weight_push import run_trainer

    ckpt = str(make_model("tiny", tmp_path / "pushed", seed=6) / "model.safetensors")
    url, proc = start_server()
    try:
        out = run_trainer(
            url,
            [
                ["join"],
                ["push", ckpt],
                ["post", "/sleep", {"level": "2"}],
                ["post", "/v1/completions", None, {"prompt": "hi", "max_tokens": 2}],  # refused, not queued
                ["post", "/wake_up", {"tags": "weights"}],
                ["push", ckpt, {"generate": False}],
                ["post", "/wake_up", {"tags": "kv_cache"}],
                ["shutdown"],
            ],
        )
        assert [step["status"] for step in out] == [200, 200, 200, 503, 200, 200, 200, 200], out
        assert "/sleep level 2" in out[3]["body"]["error"]["message"]
        assert out[4]["body"] == {"status": "sleeping", "tags": ["weights"]}
        assert out[6]["body"] == {"status": "awake", "tags": ["kv_cache"]}
        pushed, after = out[1]["choice"], greedy(url)  # the trainer generated 6 tokens, greedy() 8
        assert after["ids"][:6] == pushed["token_ids"]
        assert after["logprobs"][:6] == [e["logprob"] for e in pushed["logprobs"]["content"]]
    finally:
        stop_server(proc)
