"""How the model splits across tensor-parallel ranks, in terms of Hugging Face tensor names.

Each rank builds the model with its local shape (heads, KV heads and intermediate size divided
by tp): QKV and gate/up are column-parallel (each rank its own heads / intermediate rows), o_proj
and down_proj row-parallel (each rank its input columns; the partial outputs are all-reduced by
the layer). Embeddings, norms and the LM head are replicated, so rank 0 computes full fp32 logits
without a gather. Everything that loads weights (startup, disk updates, trainer pushes, LoRA)
reads full tensors and copies `shard(name, tensor)` into the rank's parameters.

Mixture-of-experts layers: the router is replicated; each expert is split like a dense MLP (gate/up
by intermediate rows, down by intermediate columns) and the layer all-reduces the summed experts.
Under expert parallelism (`experts_whole`) expert tensors are not split here: each rank keeps whole
experts, the ones its placement names (model/expert_parallel.py).
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING

import torch

from rlserve.model.names import COLUMN, PROJECTIONS, ROW

if TYPE_CHECKING:
    from rlserve.model.lora import LoraAdapter
    from rlserve.model.shape import ModelShape

_COLUMN = re.compile(rf"\.({'|'.join(re.escape(PROJECTIONS[n].hf) for n in COLUMN)})\.(weight|bias)$")
_ROW = re.compile(rf"\.({'|'.join(re.escape(PROJECTIONS[n].hf) for n in ROW)})\.weight$")
_EXPERT_COLUMN = re.compile(r"\.mlp\.experts\.\d+\.(gate_proj|up_proj)\.weight$")
_EXPERT_ROW = re.compile(r"\.mlp\.experts\.\d+\.down_proj\.weight$")
_STACKED_GATE_UP = re.compile(r"\.mlp\.experts\.gate_up_proj$")  # [E, 2I, H]: gate rows, then up rows
_STACKED_DOWN = re.compile(r"\.mlp\.experts\.down_proj$")  # [E, H, I]


def is_expert_tensor(name: str) -> bool:
    return bool(
        _EXPERT_COLUMN.search(name) or _EXPERT_ROW.search(name) or _STACKED_GATE_UP.search(name)
        or _STACKED_DOWN.search(name)
    )  # fmt: skip


def check_tp(shape: ModelShape, tp: int, experts_whole: bool = False) -> None:
    """Raises ValueError saying what to change when the model cannot be split `tp` ways."""
    moe = shape.moe
    if experts_whole and moe is None:
        raise ValueError("enable_expert_parallel spreads the experts of a mixture-of-experts model; this one is dense")
    if tp == 1:
        return
    if moe is not None and not experts_whole and moe.intermediate_size % tp:
        raise ValueError(
            f"parallel.tp={tp} must divide the experts' intermediate size ({moe.intermediate_size}): pick "
            "another tp, or set enable_expert_parallel = true to spread whole experts over the ranks"
        )
    for what, n in (
        ("attention heads", shape.num_heads),
        ("KV heads", shape.num_kv_heads),
        ("intermediate size", shape.intermediate_size),
    ):
        if n % tp:
            raise ValueError(
                f"parallel.tp={tp} must divide the model's {what} ({n}): pick a tp that divides "
                f"{shape.num_heads} attention heads, {shape.num_kv_heads} KV heads and intermediate "
                f"size {shape.intermediate_size}"
            )


def local_shape(shape: ModelShape, tp: int, experts_whole: bool = False) -> ModelShape:
    """The part of the model one rank computes (its experts' count is model/expert_parallel.py's)."""
    if tp == 1:
        return shape
    moe = shape.moe
    if moe is not None and not experts_whole:
        moe = dataclasses.replace(moe, intermediate_size=moe.intermediate_size // tp)
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // tp,
        num_kv_heads=shape.num_kv_heads // tp,
        intermediate_size=shape.intermediate_size // tp,
        moe=moe,
    )


def shard_dim(name: str, experts_whole: bool = False) -> int | None:
    """The dimension a full checkpoint tensor is split along across ranks; None = replicated."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    if experts_whole:
        return None
    if _EXPERT_COLUMN.search(name):
        return 0
    if _EXPERT_ROW.search(name) or _STACKED_GATE_UP.search(name):
        return 1
    if _STACKED_DOWN.search(name):
        return 2
    return None


def shard(name: str, tensor: torch.Tensor, rank: int, tp: int, experts_whole: bool = False) -> torch.Tensor:
    """This rank's slice of the full checkpoint tensor `name` (a view; a copy for stacked gate_up)."""
    dim = shard_dim(name, experts_whole) if tp > 1 else None
    if dim is None:
        return tensor
    if _STACKED_GATE_UP.search(name):  # the rank's gate rows beside its up rows
        half = tensor.shape[1] // 2
        size = half // tp
        return torch.cat((tensor.narrow(1, rank * size, size), tensor.narrow(1, half + rank * size, size)), 1)
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size)


def unshard(name: str, parts: list[torch.Tensor], experts_whole: bool = False) -> torch.Tensor:
    """The full checkpoint tensor `name` from every rank's slice, in rank order (`shard`'s inverse)."""
    dim = shard_dim(name, experts_whole) if len(parts) > 1 else None
    if dim is None:
        return parts[0]
    if _STACKED_GATE_UP.search(name):  # each rank's gate rows beside its up rows
        halves = [p.chunk(2, 1) for p in parts]
        return torch.cat([gate for gate, _ in halves] + [up for _, up in halves], 1)
    return torch.cat(parts, dim)


def shard_adapter(adapter: LoraAdapter, rank: int, tp: int) -> LoraAdapter:
    """A LoRA adapter cut like its base layers: B by output rows on column-parallel projections
    (each rank adds its own output slice), A by input columns on row-parallel ones (each rank adds
    B(A_r x_r) before the layer's all-reduce sums them to B(A x))."""
    if tp == 1:
        return adapter
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        if module in COLUMN:
            size = b.shape[0] // tp
            b = b.narrow(0, rank * size, size).contiguous()
        else:
            size = a.shape[1] // tp
            a = a.narrow(1, rank * size, size).contiguous()
        weights[(layer, module)] = (a, b)
    return dataclasses.replace(adapter, weights=weights)
