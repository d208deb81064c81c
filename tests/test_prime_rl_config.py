"""prime-rl's inference config (its inference skill's example) loads as users write it, and serves."""

from __future__ import annotations

import httpx

from conftest import server_log, start_server, stop_server
from rlserve.config.load import load_config
from rlserve.model.make import default_model_dir

PRIME_RL_CONFIG = """\
gpu_memory_utilization = 0.5
seed = 42

[model]
name = "{model}"
max_model_len = 4096
enforce_eager = true
dtype = "bfloat16"

[server]
port = 8000

[parallel]
tp = 2

[logits_processors.gibberish_detection]
# presence of section enables it; all fields have defaults

[logits_processors.repetition_detection]
window = 3000
prob_threshold = 0.99
"""


def write_config(tmp_path) -> str:
    path = tmp_path / "config.toml"
    path.write_text(PRIME_RL_CONFIG.format(model=default_model_dir()))
    return str(path)


def test_file_and_flags_load(tmp_path):
    config = load_config(["@", write_config(tmp_path), "--server.port", "8001", "--gpu-memory-utilization", "0.25"])
    assert config.gpu_memory_utilization == 0.25 and config.seed == 42 and config.server.port == 8001
    assert config.model.max_model_len == 4096 and config.model.enforce_eager and config.model.dtype == "bfloat16"
    assert config.parallel.tp == 2
    assert config.logits_processors.gibberish_detection is not None
    assert config.logits_processors.repetition_detection.window == 3000


def test_serves_with_a_kv_pool_sized_by_gpu_memory_utilization(tmp_path):
    # the only local changes: any free port, and few sequences so the pool the fraction sizes stays small
    url, proc = start_server(
        "@",
        write_config(tmp_path),
        "--gpu-memory-utilization",
        "0.5",
        "--engine.max-num-seqs",
        "4",
        defaults=(),
        command="inference",
    )
    try:
        resp = httpx.post(f"{url}/v1/completions", json={"prompt": "hello", "max_tokens": 4}, timeout=120)
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        # 4 sequences of 4096 tokens fit in half the memory: the pool holds exactly what they can use
        assert 'kv_cache_size_tokens="16384"' in metrics
        assert "tensor parallel: 2 ranks" in server_log(proc)  # [parallel] tp = 2 runs two ranks
    finally:
        stop_server(proc)
