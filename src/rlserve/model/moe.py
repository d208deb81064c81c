"""Qwen3-MoE's sparse MLP: a softmax router picks top-k experts per token; the experts' weights are
stacked ([experts, ...]) so each expert runs one matmul over all the tokens routed to it.

Arithmetic follows transformers' Qwen3MoeSparseMoeBlock (fp32 softmax, top-k, optional
renormalisation, per-expert contributions summed in expert order) so logprobs match its forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model.shape import MoeShape

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels
    from rlserve.model.lora import LoraBatch


def checkpoint_shapes(moe: MoeShape, hidden: int, layer: int) -> dict[str, tuple[int, ...]]:
    """The HF tensors of one sparse layer, in the per-expert layout hub checkpoints use."""
    p, i = f"model.layers.{layer}.mlp.", moe.intermediate_size
    out: dict[str, tuple[int, ...]] = {p + "gate.weight": (moe.num_experts, hidden)}
    for e in range(moe.num_experts):
        q = f"{p}experts.{e}."
        out |= {
            q + "gate_proj.weight": (i, hidden),
            q + "up_proj.weight": (i, hidden),
            q + "down_proj.weight": (hidden, i),
        }
    return out


def stacked_shapes(moe: MoeShape, hidden: int, layer: int) -> dict[str, tuple[int, ...]]:
    """The same experts as transformers 5 holds them in memory (what a trainer's named_parameters() pushes)."""
    p, e, i = f"model.layers.{layer}.mlp.experts.", moe.num_experts, moe.intermediate_size
    return {p + "gate_up_proj": (e, 2 * i, hidden), p + "down_proj": (e, hidden, i)}


def target_of(params: dict[str, torch.Tensor], moe: MoeShape, layer: str, suffix: str) -> torch.Tensor | None:
    """The slice of our stacked parameters holding the HF tensor `model.layers.<layer>.<suffix>`
    (per-expert names, or transformers 5's already-stacked `mlp.experts.gate_up_proj`/`down_proj`)."""
    p = f"layers.{layer}.mlp."
    if suffix == "mlp.gate.weight":
        return params[p + "gate"]
    if suffix in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
        return params[p + suffix.rsplit(".", 1)[1]]
    parts = suffix.split(".")  # mlp.experts.<e>.<proj>.weight
    if len(parts) != 5 or parts[1] != "experts" or not parts[2].isdigit() or parts[4] != "weight":
        return None
    e, proj, i = int(parts[2]), parts[3], moe.intermediate_size
    if e >= moe.num_experts:
        return None
    if proj == "gate_proj":
        return params[p + "gate_up_proj"][e].narrow(0, 0, i)
    if proj == "up_proj":
        return params[p + "gate_up_proj"][e].narrow(0, i, i)
    if proj == "down_proj":
        return params[p + "down_proj"][e]
    return None


class SparseMoe(nn.Module):
    """Drop-in for the dense MLP of a sparse layer. Keeps the experts it chose in the last forward
    (`last_experts`, [tokens, top_k], best first) for router replay."""

    def __init__(self, moe: MoeShape, hidden: int, layer: int):
        super().__init__()
        self.layer, self.top_k, self.norm_topk_prob = layer, moe.top_k, moe.norm_topk_prob
        self.num_experts = moe.num_experts
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden, moe.intermediate_size))
        self.last_experts: torch.Tensor | None = None
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums the ranks' parts

    def route(self, x: torch.Tensor, kernels: CpuKernels | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in x's dtype, expert ids [T, k]) as transformers' router computes them."""
        probs = F.softmax(_linear(x, self.gate, kernels), dim=-1, dtype=torch.float)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def forward(
        self, x: torch.Tensor, lora: LoraBatch | None = None, kernels: CpuKernels | None = None
    ) -> torch.Tensor:
        weights, experts = self.route(x, kernels)
        self.last_experts = experts
        flat = experts.view(-1)
        order = flat.argsort(stable=True)  # assignments grouped by expert, token order within
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens = order // self.top_k
        out = self.run_experts(x.index_select(0, tokens), counts, kernels)
        out.mul_(weights.view(-1).index_select(0, order).unsqueeze(1))
        out = combine(out, x, tokens, order, experts)
        return out if self.reduce is None else self.reduce(out)

    def run_experts(self, xs: torch.Tensor, counts: list[int], kernels: CpuKernels | None) -> torch.Tensor:
        """Rows grouped by expert (counts[e] rows for expert e, in expert order) through their experts."""
        out = torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            gate_up = _linear(xs[start : start + n], self.gate_up_proj[e], kernels)
            if kernels is not None:
                act = kernels.silu_mul(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                act = F.silu(gate) * up
            out[start : start + n] = _linear(act, self.down_proj[e], kernels)
            start += n
        return out


def _linear(x: torch.Tensor, weight: torch.Tensor, kernels: CpuKernels | None) -> torch.Tensor:
    """F.linear, or under batch-invariant kernels (`row_invariant`) their GEMV: an expert's rows are
    as many as the step routed to it, and only the GEMV computes a row the same way at any count."""
    if kernels is not None and getattr(kernels, "row_invariant", False):
        return kernels.gemv(x, weight)
    return F.linear(x, weight)


def combine(out: torch.Tensor, x: torch.Tensor, tokens: torch.Tensor, order: torch.Tensor, experts: torch.Tensor):
    """Each token's expert outputs (rows grouped by expert: `order` of the flat assignments) summed
    into [T, hidden], from zero in ascending expert id. On CPU index_add_ adds them in that order; on
    a GPU it adds with atomics in no fixed order, so the rows go back to their (token, choice) places
    and the choices are summed one by one."""
    if x.device.type == "cpu":
        return torch.zeros_like(x).index_add_(0, tokens, out)
    return sum_by_expert_id(out, x, order, experts)


def sum_by_expert_id(out: torch.Tensor, x: torch.Tensor, order: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """`combine` without atomics: CPU index_add_'s sums on any device (fp32, or fp64 for fp64 x; in
    ascending expert id, rounded once to x's dtype)."""
    placed = torch.empty_like(out).index_copy_(0, order, out).view(*experts.shape, -1)  # [T, k, hidden]
    by_id = experts.argsort(dim=1, stable=True)
    total = torch.zeros_like(x, dtype=torch.promote_types(x.dtype, torch.float32))
    for choice in range(experts.shape[1]):
        total += placed.gather(1, by_id[:, choice, None, None].expand(-1, 1, placed.shape[2])).squeeze(1)
    return total.to(x.dtype)


def routed_experts(layers: nn.ModuleList, num_tokens: int) -> torch.Tensor:
    """The experts every sparse layer chose in the last forward: [tokens, sparse layers, top_k]."""
    chosen = [layer.mlp.last_experts[:num_tokens] for layer in layers if isinstance(layer.mlp, SparseMoe)]
    return torch.stack(chosen, dim=1)
