"""Paged KV-cache blocks: reference counts, a free list in LRU order, and the prefix cache.

A full, computed block is registered under a chained hash of (parent hash, its token ids, extra
keys). Freed blocks keep their hash and stay reusable until they are handed out again, oldest first.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence


def block_hash(parent: bytes | None, token_ids: Sequence[int], extra: bytes) -> bytes:
    """Process-independent (sha256), so keys agree across replicas."""
    h = hashlib.sha256(parent or extra)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    return h.digest()


def extra_key(weight_generation: int, adapter: str | None, adapter_generation: int, cache_salt: str | None) -> bytes:
    """What else a block's KV depends on besides its tokens: the weights, the adapter, the tenant's salt."""
    return f"w{weight_generation}|a{adapter or ''}#{adapter_generation}|s{cache_salt if cache_salt is not None else ''}".encode()


def padded_blocks(blocks: list[int], width: int) -> list[int]:
    """The first `width` block ids, padded with block 0 (padding is always masked out)."""
    blocks = blocks[:width]
    return blocks + [0] * (width - len(blocks))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.num_blocks, self.block_size, self.enable_caching = num_blocks, block_size, enable_caching
        self.ref_counts = [0] * num_blocks
        self.hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.on_evict: Callable[[int, bytes], None] | None = None  # a cached block is about to be reused

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def allocate(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.hashes[block]
        if old is not None:
            if self.cached.get(old) == block:
                if self.on_evict is not None:
                    self.on_evict(block, old)
                del self.cached[old]
            self.hashes[block] = None
        self.ref_counts[block] = 1
        return block

    def lookup(self, h: bytes) -> int | None:
        return self.cached.get(h) if self.enable_caching else None

    def is_free(self, block: int) -> bool:
        return self.ref_counts[block] == 0

    def take(self, block: int) -> None:
        """Add a reference to a block found in the prefix cache (reviving it if it was free)."""
        if self.ref_counts[block] == 0:
            del self.free[block]
        self.ref_counts[block] += 1

    def release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free[block] = None
            if self.hashes[block] is None:  # nothing worth keeping: hand it out first
                self.free.move_to_end(block, last=False)

    def register(self, block: int, h: bytes) -> None:
        if self.enable_caching and self.hashes[block] is None:
            self.hashes[block] = h
            self.cached.setdefault(h, block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; False when some hashed blocks are still referenced (they stay valid)."""
        clean = True
        for block, h in enumerate(self.hashes):
            if h is None:
                continue
            if self.ref_counts[block] > 0:
                clean = False
                continue
            self.hashes[block] = None
            self.cached.pop(h, None)
        return clean
