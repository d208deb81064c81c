"""Router replay: the experts every forwarded token was routed to, kept per KV slot beside the KV
cache. A block's routing lives and dies with its KV, so prompt positions served from the prefix
cache, n > 1 siblings sharing prompt blocks and recomputed (preempted) sequences all read the
experts of the tokens they hold, and a finished sequence reads its rows from its block table.
"""

from __future__ import annotations

import base64

import numpy as np
import torch

from rlserve.model.shape import MoeShape


class RoutedExpertsPool:
    def __init__(self, moe: MoeShape, num_blocks: int, block_size: int):
        self.block_size = block_size
        # one block more than the pool hands out, like the KV cache (scratch block of padded rows)
        self.ids = torch.zeros(
            (num_blocks + 1) * block_size, len(moe.sparse_layers), moe.top_k, dtype=moe.expert_id_dtype
        )

    def record(self, slots: torch.Tensor, experts: torch.Tensor) -> None:
        """experts: [tokens, sparse layers, top_k] chosen for the tokens written to `slots`."""
        self.ids.index_copy_(0, slots.to(self.ids.device), experts.to(self.ids.dtype).cpu())

    def copy(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        self.ids.index_copy_(0, dst_slots.cpu(), self.ids.index_select(0, src_slots.cpu()))

    def block_rows(self, block: int) -> torch.Tensor:
        """A block's rows, to travel with its KV through the offload tiers."""
        return self.ids[block * self.block_size : (block + 1) * self.block_size]

    def block_metadata(self, block: int) -> dict[str, torch.Tensor]:
        """A block's rows as the per-block array a P/D transfer carries with its KV (engine/kv/transfer.py):
        the decode server's pull writes them in place."""
        return {"routed_experts": self.block_rows(block)}

    def restore_block(self, block: int, rows: torch.Tensor) -> None:
        self.block_rows(block).copy_(rows.to(self.ids.dtype))

    def read(self, block_table: list[int], num_tokens: int) -> np.ndarray:
        """Rows for positions [0, num_tokens): [num_tokens, sparse layers, top_k]."""
        bs = self.block_size
        blocks = torch.tensor(block_table[: -(-num_tokens // bs)], dtype=torch.long)
        slots = (blocks.unsqueeze(1) * bs + torch.arange(bs)).view(-1)[:num_tokens]
        rows = self.ids.index_select(0, slots).numpy()
        return rows.view(np.uint16) if rows.dtype == np.int16 else rows


def encode_routed_experts(rows: np.ndarray, start: int) -> dict:
    """docs/protocols.md §2.14: base64 of the raw little-endian C-order rows from `start` on."""
    part = rows[start:]
    dtype = np.dtype("<u1") if part.size == 0 or int(part.max()) <= 255 else np.dtype("<u2")
    part = np.ascontiguousarray(part, dtype=dtype)
    return {
        "data": base64.b64encode(part.tobytes()).decode("ascii"),
        "shape": list(part.shape),
        "start": start,
        "dtype": dtype.name,
    }


def offload_routed_experts(offload, routing: RoutedExpertsPool) -> None:
    """Router replay with KV offload: a block's routed experts travel with its KV; one without them is recomputed."""
    offload.required_metadata = frozenset({"routed_experts"})
    offload.metadata_of = routing.block_metadata
    offload.restore_metadata = lambda block, md: routing.restore_block(block, md["routed_experts"])
