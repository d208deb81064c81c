"""How the model splits across tensor-parallel ranks, in terms of Hugging Face tensor names.

Each rank builds the model with its local shape (heads, KV heads and intermediate size divided
by tp): QKV and gate/up are column-parallel (each rank its own heads / intermediate rows), o_proj
and down_proj row-parallel (each rank its input columns; the partial outputs are all-reduced by
the layer). Embeddings, norms and the LM head are replicated, so rank 0 computes full fp32 logits
without a gather. Everything that loads weights (startup, disk updates, trainer pushes, LoRA)
reads full tensors and copies `shard(name, tensor)` into the rank's parameters.
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


def check_tp(shape: ModelShape, tp: int) -> None:
    """Raises ValueError saying what to change when the model cannot be split `tp` ways."""
    if tp == 1:
        return
    if shape.moe is not None:
        raise ValueError(
            f"parallel.tp={tp}: tensor parallelism does not split mixture-of-experts models yet; "
            "serve this model with parallel.tp=1 (parallel.dp scales it across cores or devices)"
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


def local_shape(shape: ModelShape, tp: int) -> ModelShape:
    """The part of the model one rank computes."""
    if tp == 1:
        return shape
    return dataclasses.replace(
        shape,
        num_heads=shape.num_heads // tp,
        num_kv_heads=shape.num_kv_heads // tp,
        intermediate_size=shape.intermediate_size // tp,
    )


def shard_dim(name: str) -> int | None:
    """The dimension a full checkpoint tensor is split along across ranks; None = replicated."""
    if _COLUMN.search(name):
        return 0
    if _ROW.search(name):
        return 1
    return None


def shard(name: str, tensor: torch.Tensor, rank: int, tp: int) -> torch.Tensor:
    """This rank's slice of the full checkpoint tensor `name` (a view)."""
    dim = shard_dim(name) if tp > 1 else None
    if dim is None:
        return tensor
    size = tensor.shape[dim] // tp
    return tensor.narrow(dim, rank * size, size)


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
