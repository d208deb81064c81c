"""One step's attention inputs over the paged KV cache (AttentionBatch, its prefills and cascade plan): built by
the engine's runner, read by the model's attention, sent to tensor-parallel workers."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels
    from rlserve.model.lora import LoraBatch


@dataclass(slots=True)
class PrefillSeq:
    """One sequence's chunk in a step: query rows [q_start, q_start + q_len) of the packed batch."""

    q_start: int
    q_len: int
    ctx_len: int  # tokens of context the chunk attends to, including itself
    ctx_slots: torch.Tensor | None  # KV slots of the whole context; None when the chunk is the whole context
    mask: torch.Tensor | None = None  # [q_len, ctx_len] causal mask past a cached prefix (with ctx_slots)


@dataclass(slots=True)
class CascadePlan:
    """Decode attention split in two for sequences that share leading KV blocks (n samples of one
    prompt, or requests whose prompts hit the same cached prefix): each group's queries attend to
    the shared prefix together, gathered once, then each sequence to the rest of its own context;
    the halves are merged by their log-sum-exp. Grouped rows come first in the batch, each group's
    rows together; groups are padded to the same width."""

    prefix_blocks: torch.Tensor  # [groups * prefix_width] shared blocks of each group, padded
    prefix_mask: torch.Tensor | None  # [groups, 1, 1, prefix_width * block_size] additive; None = no padding
    group_width: int  # most members in a group
    num_grouped: int  # decode rows [0, num_grouped) belong to a group
    # decode row of each group member, padding rows point at row num_grouped; None when every
    # group is full width (the grouped rows are then exactly [0, groups * group_width))
    query_rows: torch.Tensor | None
    suffix_blocks: torch.Tensor  # [B * suffix_width] each sequence's blocks after its group's prefix
    suffix_mask: torch.Tensor  # [B, 1, 1, suffix_width * block_size] additive


@dataclass(slots=True)
class AttentionBatch:
    """Where each token's K/V goes and what each query attends to. Decode rows come first."""

    slot_mapping: torch.Tensor  # [T] KV slot of every token in the step
    num_decode: int
    # [num_decode * width] each decode sequence's KV blocks, padded; gathered whole blocks at a
    # time (large contiguous copies), positions past a sequence's context masked out
    decode_blocks: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, width * block_size] True = attend; None with kernels
    decode_lens: torch.Tensor | None  # [num_decode] context length of each decode row
    cascade: CascadePlan | None
    prefills: list[PrefillSeq]
    block_size: int = 16
    lora: LoraBatch | None = None  # adapters by row group, when any request in the step uses one
    # C kernels for decode attention and the element-wise steps (cpu_kernels.py); None = PyTorch ops
    kernels: CpuKernels | None = None
