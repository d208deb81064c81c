"""Whole KV blocks under tensor parallelism: the ranks' head slices, for P/D transfer (engine/kv/transfer.py)
and the Mooncake store (engine/kv/mooncake.py).

Each rank holds its KV heads' slice of every block, while the wire always carries whole blocks (every head,
as a tp=1 pool holds them), so prefill and decode servers of any tp pair up. Rank 0 speaks the wire for its
engine. Prefill side: when a request is pinned, rank 0 gathers its workers' slices of the blocks (a gloo
gather on a group of its own, between steps) and serves the whole blocks from that host copy. Decode side:
rank 0 receives whole blocks, keeps its heads and sends each worker its heads (KVWrite), which the worker
applies before the next step, the first that may read them: its inbox is read in order. The Mooncake store
likewise keeps whole blocks: rank 0 gathers a block it saves and scatters a block it loads.
"""

from __future__ import annotations

import torch

from rlserve.config.schema import Config
from rlserve.engine.tp.comm import KVGather, KVWrite, Tensor, encode, gather_all


def uses_kv_group(config: Config) -> bool:
    """Whether rank 0 and its workers make the group that whole blocks are gathered on (both ask the config)."""
    offload = config.kv_cache_offload
    return config.kv_transfer is not None or (offload is not None and offload.type == "mooncake")


def _slots(blocks: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([b * block_size + i for b in blocks for i in range(block_size)], device=device)


def read_slice(kv_cache: torch.Tensor, blocks: list[int], block_size: int) -> torch.Tensor:
    """This rank's heads of `blocks`, on the host: `[layers, 2, len(blocks) * block_size, heads, dim]`."""
    return kv_cache.index_select(2, _slots(blocks, block_size, kv_cache.device)).cpu()


@torch.inference_mode()
def write_slice(kv_cache: torch.Tensor, blocks: list[int], block_size: int, part: torch.Tensor) -> None:
    kv_cache.index_copy_(2, _slots(blocks, block_size, kv_cache.device), part.to(kv_cache.device))


class RankSlices:
    """Rank 0's side: whole blocks from every rank's slices, and whole blocks into them."""

    def __init__(self, leader, kv_cache: torch.Tensor, block_size: int):
        if leader.kv_group is None:
            raise RuntimeError("the tensor-parallel workers were started without the KV transfer group")
        self.leader, self.kv_cache, self.block_size = leader, kv_cache, block_size
        self.tp, self.heads = leader.tp, kv_cache.shape[3]

    def gather(self, blocks: list[int]) -> torch.Tensor:
        """Whole blocks on the host, `[len(blocks), layers, 2, block_size, heads * tp, dim]` (contiguous).
        Called on the engine thread after the step that wrote them: each worker reads its inbox in order."""
        self.leader._broadcast(encode(KVGather(blocks)))
        parts = gather_all(self.leader.kv_group, read_slice(self.kv_cache, blocks, self.block_size), 0, self.tp)
        whole = torch.cat(parts, 3)
        layers, _, _, heads, dim = whole.shape
        return whole.view(layers, 2, len(blocks), self.block_size, heads, dim).permute(2, 0, 1, 3, 4, 5).contiguous()

    def write(self, blocks: list[int], whole: list[torch.Tensor]) -> None:
        """Whole blocks (each `[layers, 2, block_size, heads * tp, dim]`) into pool `blocks` of every rank."""
        if not blocks:
            return
        kv = torch.stack(whole, 2).flatten(2, 3)  # [layers, 2, n * block_size, heads * tp, dim]
        h = self.heads
        write_slice(self.kv_cache, blocks, self.block_size, kv[:, :, :, :h])
        with self.leader.send_lock:  # the loop thread's steps and the helper's staged work share the inboxes
            for rank, inbox in enumerate(self.leader.inboxes, start=1):
                inbox.send(encode(KVWrite(blocks, Tensor.of(kv[:, :, :, rank * h : (rank + 1) * h]))))


def serve_gather(kv_group, kv_cache: torch.Tensor, block_size: int, rank: int, tp: int, msg: KVGather) -> None:
    """A worker's side of RankSlices.gather."""
    gather_all(kv_group, read_slice(kv_cache, msg.blocks, block_size), rank, tp)
