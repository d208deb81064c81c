"""The one table of a decoder layer's Hugging Face projection names.

For each projection a checkpoint or an adapter names (`q_proj`, ..., `down_proj`) it says which fused
parameter of ours holds it and at which slot, how tensor parallelism splits it, and its (in, out)
sizes for a model shape. The loader, the LoRA readers (PEFT and mlx-lm) and tensor parallelism all
read it, so a new projection or a new fusion is written here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from rlserve.model.shape import ModelShape


@dataclass(frozen=True, slots=True)
class Projection:
    block: Literal["self_attn", "mlp"]
    name: str  # the HF module name: "q_proj"
    fused: str  # our parameter's module under the block: "qkv_proj"
    slot: int  # index of this projection's rows inside the fused output
    split: Literal["column", "row"]  # tensor parallelism: column = output rows per rank, row = input columns

    @property
    def hf(self) -> str:
        """The HF suffix under `model.layers.N.`: "self_attn.q_proj"."""
        return f"{self.block}.{self.name}"

    @property
    def ours(self) -> str:
        """Our parameter's module under `layers.N.`: "self_attn.qkv_proj"."""
        return f"{self.block}.{self.fused}"


PROJECTIONS: dict[str, Projection] = {
    p.name: p
    for p in (
        Projection("self_attn", "q_proj", "qkv_proj", 0, "column"),
        Projection("self_attn", "k_proj", "qkv_proj", 1, "column"),
        Projection("self_attn", "v_proj", "qkv_proj", 2, "column"),
        Projection("self_attn", "o_proj", "o_proj", 0, "row"),
        Projection("mlp", "gate_proj", "gate_up_proj", 0, "column"),
        Projection("mlp", "up_proj", "gate_up_proj", 1, "column"),
        Projection("mlp", "down_proj", "down_proj", 0, "row"),
    )
}
COLUMN = tuple(n for n, p in PROJECTIONS.items() if p.split == "column")
ROW = tuple(n for n, p in PROJECTIONS.items() if p.split == "row")


def dims(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """Each projection's (in, out) features for a dense layer of `shape`."""
    h, i = shape.hidden_size, shape.intermediate_size
    q, kv = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    return {
        "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
        "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
    }  # fmt: skip


def fused_slice(shape: ModelShape, name: str) -> tuple[int, int]:
    """(start, size) of projection `name`'s output rows inside its fused parameter."""
    sizes = dims(shape)
    fused = PROJECTIONS[name]
    start = sum(sizes[p.name][1] for p in PROJECTIONS.values() if p.ours == fused.ours and p.slot < fused.slot)
    return start, sizes[name][1]
