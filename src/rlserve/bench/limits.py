"""What this machine can do at most on a workload, so each benchmark figure reads as a share of it.

Two measured limits (issue 43): the matmul peak, the fastest way this CPU runs one prefill-shaped
linear in the dtype (MKL, oneDNN's packed weight, rlserve's panel GEMM), and the memory bandwidth,
one streamed read of more than the caches hold. A workload's limit in output tokens/s is a roofline
over the steps an ideal server would run: its distinct prompts' prefill, then one decode step per new
token over every sequence at once, each step taking at least the longer of its FLOPs over the peak
and its bytes (every weight once, and the KV it attends to) over the bandwidth. Nothing a server
does can beat it (for weights larger than the caches, as every benchmarked model's are: a tiny model's
stay in cache and can beat the bandwidth term), so "share of the limit" says how much is left on the
table, and a target above it cannot be met on this machine."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

PEAK_SHAPE = (2048, 576, 1536)  # rows x in -> out: issue 43's prefill-shaped linear (SmolLM2-135M's MLP)
STREAM_BYTES = 512 << 20  # well past any L3 here, so the read comes from memory


def _best_seconds(fn: Callable[[], object], repeats: int = 7) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def matmul_paths(dtype: torch.dtype) -> dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]]:
    """Each way this CPU can run x @ W^T for weights of `dtype`, as (x, W) -> out."""
    paths: dict[str, Callable] = {}
    if dtype == torch.float32:
        paths["F.linear (MKL)"] = lambda x, w: F.linear(x, w)
    else:
        paths["F.linear bf16"] = lambda x, w: F.linear(x, w)
        paths["fp32 arithmetic on bf16 weights"] = lambda x, w: F.linear(x.float(), w.float()).to(dtype)
    mkldnn = torch.backends.mkldnn.is_available()
    if mkldnn and (dtype == torch.float32 or torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        paths["oneDNN packed"] = _onednn(lambda w: w, lambda x: x, dtype)
    if mkldnn and dtype == torch.bfloat16:
        paths["oneDNN packed fp32 copy of bf16 weights"] = _onednn(lambda w: w.float(), lambda x: x.float(), dtype)
    from rlserve.model.cpu_kernels import cpu_kernels

    kernels = cpu_kernels()
    if kernels is not None and kernels.panels_beat_the_libraries(dtype):
        packed: dict[int, torch.Tensor] = {}

        def panels(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            if id(w) not in packed:
                packed[id(w)] = kernels.gemm_pack(w)
            return kernels.gemv(x, w, packed=packed[id(w)], threads=torch.get_num_threads())

        paths["rlserve panels"] = panels
    return paths


def _onednn(weight_as, x_as, dtype: torch.dtype) -> Callable:
    packed: dict[int, torch.Tensor] = {}

    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        if id(w) not in packed:
            packed[id(w)] = torch.ops.mkldnn._reorder_linear_weight(weight_as(w), x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x_as(x), packed[id(w)], None, "none", [], "").to(dtype)

    return run


def matmul_peak(dtype: torch.dtype, shape: tuple[int, int, int] = PEAK_SHAPE) -> dict[str, float]:
    """GFLOP/s of each path in `matmul_paths` on one linear of `shape` (the best of several calls)."""
    rows, k, n = shape
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    return {
        name: 2 * rows * k * n / _best_seconds(lambda fn=fn: fn(x, w)) / 1e9 for name, fn in matmul_paths(dtype).items()
    }


def memory_bandwidth(nbytes: int = STREAM_BYTES) -> float:
    """GB/s of one summing read of `nbytes` on torch's threads (the best of several)."""
    data = torch.ones(nbytes // 4)
    return nbytes / _best_seconds(data.sum, repeats=5) / 1e9


@dataclass(frozen=True, slots=True)
class ModelCost:
    """A dense decoder's work per token, from its config.json (None for models this does not count: MoE)."""

    projection_params: int  # every layer's q, k, v, o, gate, up and down weights
    head_params: int  # the LM head (hidden x vocab), run for each token that is sampled
    attention_width: int  # layers x heads x head_dim: QK^T and PV cost 4 x this a context position
    kv_bytes_per_token: int
    weight_bytes: int  # what one step reads at least: the projections and the head

    @classmethod
    def from_config(cls, config: dict, dtype_bytes: int) -> ModelCost | None:
        if config.get("num_experts") or config.get("num_local_experts"):
            return None
        hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"]
        heads = config["num_attention_heads"]
        kv_heads = config.get("num_key_value_heads") or heads
        head_dim = config.get("head_dim") or hidden // heads
        per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
        head = hidden * config["vocab_size"]
        return cls(
            projection_params=layers * per_layer,
            head_params=head,
            attention_width=layers * heads * head_dim,
            kv_bytes_per_token=layers * 2 * kv_heads * head_dim * dtype_bytes,
            weight_bytes=(layers * per_layer + head) * dtype_bytes,
        )

    def prompt_flops(self, prompt_len: int) -> float:
        """One prompt's prefill: every token through the projections, causal attention, and the LM head
        for its last token only."""
        attention = 4 * self.attention_width * prompt_len * (prompt_len + 1) / 2
        return 2 * self.projection_params * prompt_len + attention + 2 * self.head_params

    def decode_flops(self, context: int) -> float:
        return 2 * (self.projection_params + self.head_params) + 4 * self.attention_width * context


def workload_limit(
    cost: ModelCost, prompts: int, n: int, prompt_len: int, output_len: int, gflops: float, gbytes_s: float
) -> float:
    """Output tokens/s that no server can beat on this machine: `prompts` distinct prompts (each prefilled
    once, its n samples sharing it) with n samples of `output_len` tokens each, all decoding together."""
    flops_s, bytes_s = gflops * 1e9, gbytes_s * 1e9
    seconds = max(prompts * cost.prompt_flops(prompt_len) / flops_s, cost.weight_bytes / bytes_s)
    rows = prompts * n
    for step in range(1, output_len):  # the prefill sampled each sequence's first token
        context = prompt_len + step
        kv_tokens = prompts * prompt_len + rows * step  # a shared prompt's KV read once: the least there is
        step_bytes = cost.weight_bytes + kv_tokens * cost.kv_bytes_per_token
        seconds += max(rows * cost.decode_flops(context) / flops_s, step_bytes / bytes_s)
    return rows * output_len / seconds
