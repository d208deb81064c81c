"""vLLM's sleep mode on CPU: /sleep (level 1) and /release_kv_cache_memory really return the KV cache's
memory to the OS, /wake_up gets it back, and greedy output is the same before and after. Level 2, which
releases the weights too: tests/test_vllm_sleep_weights.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

import httpx

from conftest import start_server, stop_server

KV_BYTES = 256 << 20


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def greedy(url: str) -> dict:
    body = {
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 0},
    }
    choice = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=120).json()["choices"][0]
    return {"ids": choice["token_ids"], "logprobs": [e["logprob"] for e in choice["logprobs"]["content"]]}


def test_sleep_frees_and_wake_restores_kv_memory():
    url, proc = start_server(defaults=("--engine.kv_cache_bytes", str(KV_BYTES), "--model.max_model_len", "512"))
    try:
        engine_pid = int(
            subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=True).stdout.split()[0]
        )
        before = greedy(url)
        for route, params in (("/sleep", {"level": "1"}), ("/release_kv_cache_memory", {})):
            awake_rss = rss(engine_pid)
            r = httpx.post(f"{url}{route}", params=params, timeout=60)
            assert r.status_code == 200, r.text
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": True}
            assert awake_rss - rss(engine_pid) > KV_BYTES * 0.8, route
            assert httpx.post(f"{url}/resume").status_code == 409  # asleep: wake first
            r = httpx.post(f"{url}/wake_up", params={"tags": "weights"})
            assert r.json() == {"status": "sleeping", "tags": ["weights"]}
            r = httpx.post(f"{url}/wake_up", params={"tags": "kv_cache"})
            assert r.json() == {"status": "awake", "tags": ["kv_cache"]}
            assert httpx.get(f"{url}/is_sleeping").json() == {"is_sleeping": False}
            assert rss(engine_pid) - (awake_rss - KV_BYTES) > KV_BYTES * 0.8
            assert greedy(url) == before
        assert httpx.post(f"{url}/sleep", params={"level": "3"}).status_code == 400
        assert httpx.post(f"{url}/wake_up", params={"tags": "gpu"}).status_code == 400
    finally:
        stop_server(proc)
