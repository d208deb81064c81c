"""KV offload under tensor parallelism: a worker rank's tiers, which follow rank 0's.

Each rank holds its heads' slice of every KV block, so each keeps its own CPU tier and disk directory with
its slice of the same blocks. Rank 0's tiers (kv/offload.py) decide everything, from which block is saved and
which slot it takes to what spills, what is dropped and what loads; each move travels with the next step
(comm.Move in Step.offload) and a worker replays it here before that step's forward. A block is thus in every
rank's tiers or in none, and a hit on rank 0 is a hit on every rank. Rank 0's metadata (routed experts for
router replay) stays on rank 0, where the routing is recorded.
"""

from __future__ import annotations

import torch

from rlserve.config.schema import KVOffloadConfig
from rlserve.engine.kv.format import KVBlock
from rlserve.engine.kv.offload import DiskTier, cpu_slots
from rlserve.engine.tp.comm import Move


class WorkerTiers:
    """A worker's CPU slots and disk files, written and read only as rank 0's moves say."""

    def __init__(self, config: KVOffloadConfig, kv_cache: torch.Tensor, block_size: int, rank: int, ranks: int):
        self.kv_cache, self.block_size, self.rank = kv_cache, block_size, rank
        layers, _, _, kv_heads, head_dim = kv_cache.shape
        self.block_shape = (layers, 2, block_size, kv_heads, head_dim)
        block_bytes = kv_cache[:, :, :block_size].numel() * kv_cache.element_size()
        # the same slot count as rank 0's: the slices are the same size on every rank
        slots = cpu_slots(config, block_bytes, ranks)
        self.cpu_buffer = torch.empty((slots, *self.block_shape), dtype=kv_cache.dtype)
        # rank 0 enforces the disk cap and drops files for every rank: no cap of its own here
        self.disk = DiskTier(config.disk.path, None, f"rlserve-kv-rank{rank}-") if config.disk is not None else None
        self.weight_generation = 0

    def _pool_block(self, block: int) -> torch.Tensor:
        return self.kv_cache[:, :, block * self.block_size : (block + 1) * self.block_size]

    def apply(self, moves: list[Move]) -> None:
        for move in moves:
            kind = move.kind
            if kind == "save":
                self.cpu_buffer[move.slot].copy_(self._pool_block(move.block))
            elif kind == "load":
                self._pool_block(move.block).copy_(self.cpu_buffer[move.slot])
            elif kind == "spill":
                self._disk(kind).write(KVBlock(move.key, self.cpu_buffer[move.slot], self.weight_generation))
            elif kind == "drop":
                if move.key in self._disk(kind):
                    self._disk(kind).remove(move.key)
            elif kind == "load_disk":
                self._pool_block(move.block).copy_(self._read(move.key))
            elif kind == "generation":
                self.weight_generation = move.slot
            else:
                raise ValueError(f"unknown KV offload move {kind!r}")

    def _disk(self, kind: str) -> DiskTier:
        if self.disk is None:
            raise RuntimeError(f"rank 0 sent a disk move ({kind}) and this rank has no disk tier")
        return self.disk

    def _read(self, key: bytes) -> torch.Tensor:
        """This rank's slice of a block rank 0 just read from its disk; a rank that cannot read its own copy
        cannot compute the step (rank 0 already counts the block as loaded), so it fails the engine."""
        disk = self._disk("load_disk")
        found = disk.read(key, self.block_shape, self.kv_cache.dtype) if key in disk else None
        if found is None:
            raise RuntimeError(
                f"tensor-parallel rank {self.rank}: KV block {key.hex()[:16]} is missing or damaged in this rank's "
                f"disk tier ({disk.dir}) while rank 0 loaded it"
            )
        return found.kv

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()
