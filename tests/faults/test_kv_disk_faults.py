"""The KV disk tier's directory becomes unusable while the server runs (here: removed and replaced by a file, as
root ignores chmod): disk offload stops with one warning, serving goes on, and every answer is the one computed
before the fault (the tier only ever saves recomputation). A full disk is covered in tests/test_kv_offload.py."""

from __future__ import annotations

import random
import shutil

import httpx

from conftest import server_log, start_server, stop_server

BLOCK = 16


def answers(url: str, prompts: list[list[int]]) -> list[tuple[list[int], list[float]]]:
    out = []
    for prompt in prompts:
        body = {"token_ids": prompt, "sampling_params": {"temperature": 0, "max_tokens": 4, "logprobs": 0}}
        r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        out.append((choice["token_ids"], [e["logprob"] for e in choice["logprobs"]["content"]]))
    return out


def same_as(got, expected) -> None:
    """The same tokens; logprobs to fp32 noise (cached prefixes and recomputed ones batch differently)."""
    for (tokens, logprobs), (tokens0, logprobs0) in zip(got, expected, strict=True):
        assert tokens == tokens0
        assert max(abs(a - b) for a, b in zip(logprobs, logprobs0)) < 1e-4


def test_unusable_disk_tier_stops_offload_and_keeps_answers_unchanged(tmp_path) -> None:
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
        rng = random.Random(9)
        prompts = [[rng.randrange(250) for _ in range(200)] for _ in range(4)]  # 4 x 13 blocks; the pool holds 32
        first = answers(url, prompts)
        same_as(answers(url, prompts), first)  # served partly from the tiers
        (tier,) = disk.glob("rlserve-kv-*")
        assert any(tier.glob("*.kvb"))
        shutil.rmtree(tier)
        tier.write_text("not a directory any more")
        for _ in range(2):
            same_as(answers(url, prompts), first)
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200
        log = server_log(proc)
        assert log.count("no more blocks are written to disk") == 1
    finally:
        stop_server(proc)
