"""bench/limits.py: a model's work per token counted from its config agrees with the real model's
weights, and a workload's limit is the roofline of its steps (compute-bound at batch, bandwidth-bound
at batch 1). The measurements only have to be positive: no speed is asserted."""

from __future__ import annotations

import json

import pytest
import torch

from rlserve.bench.limits import ModelCost, matmul_paths, matmul_peak, memory_bandwidth, workload_limit
from rlserve.model.cpu_kernels import cpu_kernels


@pytest.fixture(scope="module")
def config(model_dir) -> dict:
    return json.loads((model_dir / "config.json").read_text())


def test_the_counted_weights_are_the_models(config, hf):
    cost = ModelCost.from_config(config, dtype_bytes=4)
    linears = [m for name, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"]
    assert cost.projection_params == sum(m.weight.numel() for m in linears)
    assert cost.head_params == hf.lm_head.weight.numel()
    assert cost.weight_bytes == 4 * (cost.projection_params + cost.head_params)
    attn = hf.model.layers[0].self_attn
    layers = config["num_hidden_layers"]
    assert cost.kv_bytes_per_token == layers * 2 * attn.k_proj.weight.shape[0] * 4
    assert cost.attention_width == layers * attn.q_proj.weight.shape[0]


def test_an_moe_model_is_not_counted(config):
    assert ModelCost.from_config({**config, "num_experts": 8}, dtype_bytes=4) is None


def test_batch_one_is_bound_by_reading_the_weights(config):
    """With unbounded FLOPs every step costs its bytes over the bandwidth: the weights, and the KV so far."""
    cost = ModelCost.from_config(config, dtype_bytes=4)
    prompt_len, output_len, gb_s = 16, 5, 10.0
    want = cost.weight_bytes  # the prefill reads the weights once
    want += sum(cost.weight_bytes + (prompt_len + s) * cost.kv_bytes_per_token for s in range(1, output_len))
    got = workload_limit(cost, 1, 1, prompt_len, output_len, gflops=1e12, gbytes_s=gb_s)
    assert got == pytest.approx(output_len / (want / (gb_s * 1e9)))


def test_a_batch_is_bound_by_its_flops_and_shared_prompts_are_prefilled_once(config):
    cost = ModelCost.from_config(config, dtype_bytes=4)
    prompt_len, output_len, gflops = 32, 4, 50.0
    flops = 64 * cost.prompt_flops(prompt_len) + sum(64 * cost.decode_flops(prompt_len + s) for s in range(1, 4))
    got = workload_limit(cost, 64, 1, prompt_len, output_len, gflops=gflops, gbytes_s=1e9)
    assert got == pytest.approx(64 * output_len / (flops / (gflops * 1e9)))
    grpo = workload_limit(cost, 8, 8, prompt_len, output_len, gflops=gflops, gbytes_s=1e9)
    assert grpo > got  # the same 64 sequences, 8 prompts prefilled instead of 64


def test_the_machine_is_measured():
    paths = matmul_peak(torch.float32, shape=(64, 64, 64))
    assert "F.linear (MKL)" in paths and all(g > 0 for g in paths.values())
    kernels = cpu_kernels()
    assert ("rlserve panels" in matmul_paths(torch.float32)) == bool(
        kernels and kernels.panels_beat_the_libraries(torch.float32)
    )
    assert memory_bandwidth(8 << 20) > 0


def test_the_panel_path_computes_the_linear():
    x, w = torch.randn(5, 64), torch.randn(48, 64)
    for name, fn in matmul_paths(torch.float32).items():
        torch.testing.assert_close(fn(x, w), x @ w.T, rtol=1e-5, atol=1e-5, msg=name)
