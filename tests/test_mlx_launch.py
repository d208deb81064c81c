"""The MLX RL inference server's launch line, adapters (mlx_lm.lora's layout) and client example, as written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from conftest import start_server, stop_server
from rlserve.model.make import default_model_dir

ROOT = Path(__file__).resolve().parent.parent
SEED_REQUEST = {
    "prompt": "What is machine learning?",
    "temperature": 0.7,
    "top_p": 1.0,
    "max_tokens": 128,
    "logprobs": 1,
    "policy_version": 42,
    "step_id": 1000,
    "request_id": "unique-request-id",
}
SEED_ANSWER_KEYS = {
    "request_id",
    "policy_version",
    "step_id",
    "prompt_ids",
    "completion_ids",
    "text",
    "logprobs",
    "finish_reason",
    "metadata",
}


def write_mlx_adapter(peft_dir: Path, out: Path, fine_tune_type: str = "lora") -> Path:
    """PEFT's adapter in mlx_lm.lora's layout: lora_a = A^T (in, r), lora_b = B^T (r, out), scale = alpha / r."""
    cfg = json.loads((peft_dir / "adapter_config.json").read_text())
    tensors = {}
    for key, t in load_file(peft_dir / "adapter_model.safetensors").items():
        name = (
            key.removeprefix("base_model.model.")
            .replace(".lora_A.weight", ".lora_a")
            .replace(".lora_B.weight", ".lora_b")
        )
        tensors[name] = t.t().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapters.safetensors"))
    keys = sorted({k.split(".", 3)[3].rsplit(".", 1)[0] for k in tensors})
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "num_layers": 2,
                "fine_tune_type": fine_tune_type,
                "lora_parameters": {
                    "rank": cfg["r"],
                    "scale": cfg["lora_alpha"] / cfg["r"],
                    "dropout": 0.0,
                    "keys": keys,
                },
            }
        )
    )
    return out


def test_seed_launch_line_serves_the_seed_request():
    # the seed's line with rlserve serve in place of python -m mlx_lm.inference_server; a local model and a free
    # port; an admin key, as rlserve asks of any server bound beyond loopback
    line = [
        "--model",
        str(default_model_dir()),
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--max-batch",
        "5",
        "--flush-interval-ms",
        "10",
        "--max-tokens",
        "128",
    ]
    url, proc = start_server(*line, "--server.admin-api-key", "admin-secret", defaults=())
    try:
        url = url.replace("0.0.0.0", "127.0.0.1")
        answer = httpx.post(f"{url}/generate", json=SEED_REQUEST, timeout=300).json()
        assert SEED_ANSWER_KEYS <= set(answer)
        assert answer["request_id"] == "unique-request-id" and answer["step_id"] == 1000
        assert set(answer["metadata"]) >= {"batch_size", "latency_ms", "current_policy_version"}
        assert answer["metadata"]["batch_size"] == 1
        metrics = httpx.get(f"{url}/metrics", timeout=30).json()  # a plain GET: JSON after the MLX-style launch
        assert metrics["max_batch_size"] == 5 and metrics["flush_interval_ms"] == 10
        assert set(metrics) >= {"current_policy_version", "queue_depth", "max_batch_size", "flush_interval_ms"}
        scrape = httpx.get(f"{url}/metrics", headers={"Accept": "text/plain;version=0.0.4"}, timeout=30)
        assert "vllm:num_requests_running" in scrape.text  # scrapers still get Prometheus text
    finally:
        stop_server(proc)


def test_max_tokens_default_and_metrics_format_of_a_plain_launch():
    url, proc = start_server("--max-tokens", "7", "--metrics-format", "prometheus")
    try:
        answer = httpx.post(f"{url}/generate", json={"prompt": "hi", "ignore_eos": True}, timeout=300).json()
        assert len(answer["completion_ids"]) == 7
        assert "vllm:num_requests_running" in httpx.get(f"{url}/metrics", timeout=30).text
        assert (
            httpx.get(f"{url}/metrics", headers={"Accept": "application/json"}, timeout=30).json()["max_batch_size"]
            == 256
        )
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def adapters(peft_adapter, root):
    peft_dir, _ = peft_adapter
    return {
        "peft": peft_dir,
        "mlx": write_mlx_adapter(peft_dir, root / "mlx-adapter"),
        "dora": write_mlx_adapter(peft_dir, root / "dora-adapter", fine_tune_type="dora"),
        "base": root / "lora-base",
    }


def greedy(url: str) -> tuple[list[int], list[float], int]:
    answer = httpx.post(
        f"{url}/generate",
        json={"prompt": "The adapter says", "max_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        timeout=300,
    ).json()
    return answer["completion_ids"], answer["logprobs"], answer["metadata"]["current_policy_version"]


def test_mlx_adapter_matches_peft_at_start_load_and_upload(adapters, root):
    url, proc = start_server(
        "--model",
        str(adapters["base"]),
        "--adapter-path",
        str(adapters["mlx"]),
        "--weight_roots",
        json.dumps([str(root)]),
    )
    try:
        ids, logprobs, version = greedy(url)
        assert version == 1  # the adapter at start is policy version 1
        loaded = httpx.post(f"{url}/load_adapter", json={"adapter_path": str(adapters["peft"])}, timeout=300)
        assert loaded.status_code == 200, loaded.text
        peft_ids, peft_logprobs, _ = greedy(url)
        assert ids == peft_ids and max(abs(a - b) for a, b in zip(logprobs, peft_logprobs)) < 1e-5
        loaded = httpx.post(f"{url}/load_adapter", json={"adapter_path": str(adapters["mlx"])}, timeout=300)
        assert loaded.status_code == 200, loaded.text
        mlx_ids, mlx_logprobs, _ = greedy(url)
        assert mlx_ids == peft_ids and max(abs(a - b) for a, b in zip(mlx_logprobs, peft_logprobs)) < 1e-5
        files = {
            "adapter_weights": (adapters["mlx"] / "adapters.safetensors").read_bytes(),
            "adapter_config": (adapters["mlx"] / "adapter_config.json").read_bytes(),
        }
        uploaded = httpx.post(f"{url}/upload_adapter", files=files, timeout=300)
        assert uploaded.status_code == 200, uploaded.text
        up_ids, up_logprobs, _ = greedy(url)
        assert up_ids == peft_ids and max(abs(a - b) for a, b in zip(up_logprobs, peft_logprobs)) < 1e-5
        named = httpx.post(
            f"{url}/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(adapters["mlx"])}, timeout=300
        )
        assert named.status_code == 200, named.text
        for route, kwargs in [
            ("/load_adapter", {"json": {"adapter_path": str(adapters["dora"])}}),
            (
                "/upload_adapter",
                {
                    "files": {
                        "adapter_weights": (adapters["dora"] / "adapters.safetensors").read_bytes(),
                        "adapter_config": (adapters["dora"] / "adapter_config.json").read_bytes(),
                    }
                },
            ),
        ]:
            refused = httpx.post(f"{url}{route}", timeout=300, **kwargs)
            assert refused.status_code == 400 and "fine_tune_type" in refused.json()["error"]["message"], refused.text
        # the seed's client example, unchanged but for its import line, against this server
        run = subprocess.run(
            [sys.executable, str(ROOT / "examples" / "inference_server_example.py"), url, str(adapters["mlx"])],
            check=False,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr
        assert "Generated: " in run.stdout and "New policy version: " in run.stdout
    finally:
        stop_server(proc)


def test_dora_adapter_path_at_start_is_refused(adapters, root):
    with pytest.raises(RuntimeError, match="fine_tune_type"):
        start_server("--model", str(adapters["base"]), "--adapter-path", str(adapters["dora"]), timeout=300)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"fine_tune_type": "full"}, "fine_tune_type"),
        ({"fine_tune_type": "dora"}, "fine_tune_type"),
        ({"quantization": {"bits": 4, "group_size": 64}}, "quantization"),
        ({"lora_parameters": {"rank": 4, "scale": 4.0, "keys": ["self_attn.rotary"]}}, "lora_parameters.keys"),
        ({"num_layers": 99}, "num_layers"),
        ({"extra_tensor": "model.layers.0.self_attn.q_proj.scales"}, "quantized"),
        ({"extra_tensor": "model.layers.0.self_attn.q_proj.m"}, "DoRA"),
        ({"extra_tensor": "model.layers.0.self_attn.rotary.lora_a"}, "rotary"),
    ],
)
def test_what_plain_lora_cannot_honour_is_refused_by_name(adapters, tmp_path, change, named):
    import torch
    from transformers import AutoConfig

    from rlserve.model.llama import ModelShape
    from rlserve.model.lora import AdapterError, load_peft_adapter

    out = tmp_path / "adapter"
    write_mlx_adapter(adapters["peft"], out)
    cfg = json.loads((out / "adapter_config.json").read_text())
    tensor = change.pop("extra_tensor", None)
    if tensor is not None:
        tensors = load_file(out / "adapters.safetensors") | {tensor: torch.zeros(4, 4)}
        save_file(tensors, str(out / "adapters.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps(cfg | change))
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(adapters["base"]))
    with pytest.raises(AdapterError, match=named):
        load_peft_adapter("a", out, shape, torch.float32, torch.device("cpu"))
