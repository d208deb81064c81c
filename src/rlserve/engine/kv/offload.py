"""KV-cache offload tiers behind the prefix cache: engine pool -> CPU memory -> disk.

A cached block the pool hands out again is first copied into the CPU tier; when the CPU tier is
full its least recently used block is spilled to the disk tier. Both tiers are keyed by the same
chained block hash as the prefix cache, so a block only ever matches the weights, adapter and
cache_salt it was computed under.

Under tensor parallelism (engine/tp/offload.py) each rank's tiers hold its heads' slice of the same blocks:
rank 0 decides every move and reports it through `on_move`; the workers replay the moves on their slices.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from rlserve.config.schema import KVOffloadConfig
from rlserve.engine.kv import format as kv_format
from rlserve.engine.kv.disk_dir import make_private_dir
from rlserve.engine.kv.format import BlockFormatError, KVBlock

if TYPE_CHECKING:
    from rlserve.engine.tp.leader import TensorParallelLeader

log = logging.getLogger(__name__)

_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


@dataclass(slots=True)
class OffloadStats:
    cpu_queries: int = 0  # prompt tokens looked up in the CPU tier (after missing the pool)
    cpu_hits: int = 0  # of which loaded from it
    disk_queries: int = 0  # prompt tokens looked up on disk (after missing the pool and the CPU tier)
    disk_hits: int = 0
    disk_rejected: int = 0  # blocks whose file failed its checksum or header check (recomputed)
    bytes_to_cpu: int = 0  # pool -> CPU tier
    bytes_from_cpu: int = 0  # CPU tier -> pool
    bytes_to_disk: int = 0
    bytes_from_disk: int = 0


@dataclass(slots=True)
class _CpuEntry:
    slot: int
    copied: torch.cuda.Event | None = None  # CUDA: the pool -> slot copy is done when this fires
    on_disk: bool = False
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)


class DiskTier:
    """One file per block in a private directory under `root`, removed with everything in it at close."""

    def __init__(self, root: str, max_bytes: int | None, prefix: str = "rlserve-kv-"):
        self.dir = make_private_dir(root, prefix)
        self._remove_dir = weakref.finalize(self, shutil.rmtree, self.dir, True)  # also at interpreter exit
        self.max_bytes = max_bytes
        self.files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recently used first
        self.used_bytes = 0
        self.writable = True
        self.on_remove: Callable[[bytes], None] | None = None  # tensor parallelism: the workers drop it too

    def path(self, h: bytes) -> Path:
        return self.dir / f"{h.hex()}.kvb"

    def __contains__(self, h: bytes) -> bool:
        return h in self.files

    def write(self, block: KVBlock) -> int:
        """Bytes written; 0 when the disk is full (writes stop, with one warning) or the cap is too small."""
        if not self.writable or block.block_hash in self.files:
            return 0
        size = block.kv.nbytes + 4096
        while self.max_bytes is not None and self.files and self.used_bytes + size > self.max_bytes:
            self.remove(next(iter(self.files)))
        if self.max_bytes is not None and self.used_bytes + size > self.max_bytes:
            return 0
        try:
            size = kv_format.write_file(self.path(block.block_hash), block)
        except OSError as e:  # serving goes on without new disk blocks
            self.writable = False
            why = "is full" if e.errno in _DISK_FULL else "cannot be written"
            log.warning("KV disk tier %s %s (%s): no more blocks are written to disk", self.dir, why, e)
            return 0
        self.files[block.block_hash] = size
        self.used_bytes += size
        return size

    def read(self, h: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> KVBlock | None:
        """The block, or None (and its file removed) when it fails any check."""
        self.files.move_to_end(h)
        try:
            return kv_format.read_file(self.path(h), expect_hash=h, expect_shape=shape, expect_dtype=dtype)
        except (OSError, BlockFormatError) as e:
            log.warning("KV block %s on disk is unusable (%s): recomputing it", h.hex()[:16], e)
            self.remove(h)
            return None

    def remove(self, h: bytes) -> None:
        self.used_bytes -= self.files.pop(h)
        if self.on_remove is not None:
            self.on_remove(h)
        with contextlib.suppress(OSError):  # a directory gone or unusable under us: the entry goes all the same
            self.path(h).unlink()

    def clear(self) -> None:
        for h in list(self.files):
            self.remove(h)

    def close(self) -> None:
        self.files.clear()
        self._remove_dir()


def cpu_slots(config: KVOffloadConfig, block_bytes: int, ranks: int) -> int:
    """How many blocks the CPU tier holds. Like vLLM's kv_offloading_size, cpu.num_bytes is the total over the
    tensor-parallel ranks: each holds its slice (`block_bytes`) of every block."""
    capacity = config.cpu.num_bytes // (block_bytes * ranks)
    if capacity == 0:
        raise ValueError(
            f"kv_cache_offload.cpu.num_bytes ({config.cpu.num_bytes}) holds no KV block of "
            f"{block_bytes * ranks} bytes: raise it"
        )
    return capacity


class KVOffload:
    def __init__(
        self,
        config: KVOffloadConfig,
        kv_cache: torch.Tensor,
        block_size: int,
        leader: TensorParallelLeader | None = None,
    ):
        self.kv_cache, self.block_size = kv_cache, block_size
        layers, _, _, kv_heads, head_dim = kv_cache.shape
        self.block_shape = (layers, 2, block_size, kv_heads, head_dim)
        self.block_bytes = kv_cache[:, :, :block_size].numel() * kv_cache.element_size()
        ranks = 1 if leader is None else leader.tp
        capacity = cpu_slots(config, self.block_bytes, ranks)
        self.cuda = kv_cache.device.type == "cuda"
        # pinned host memory and a side stream: evictions copy out while the step goes on
        self.cpu_buffer = torch.empty((capacity, *self.block_shape), dtype=kv_cache.dtype, pin_memory=self.cuda)
        self.copy_stream = torch.cuda.Stream(kv_cache.device) if self.cuda else None
        self.cpu: OrderedDict[bytes, _CpuEntry] = OrderedDict()  # least recently used first
        self.free_slots = list(range(capacity))
        self.disk = None
        if config.disk is not None:  # disk.num_bytes too is the total over the ranks
            cap = config.disk.num_bytes and config.disk.num_bytes // ranks
            self.disk = DiskTier(config.disk.path, cap, "rlserve-kv-" if leader is None else "rlserve-kv-rank0-")
        # tensor parallelism: every move of a block (kind, pool block, CPU slot, hash) goes to the workers
        self.on_move: Callable[[str, int, int, bytes], None] | None = None
        if leader is not None:
            self.on_move = leader.record_move
            if self.disk is not None:
                self.disk.on_remove = lambda h: leader.record_move("drop", -1, -1, h)
        self.stats = OffloadStats()
        self.weight_generation = 0  # recorded in disk blocks' headers
        # Router replay (MoE): per-block arrays the engine keeps beside the KV (routed experts)
        # travel with the block; a block lacking one the engine requires is recomputed instead.
        self.metadata_of: Callable[[int], dict[str, torch.Tensor]] | None = None
        self.restore_metadata: Callable[[int, dict[str, torch.Tensor]], None] | None = None
        self.required_metadata: frozenset[str] = frozenset()

    @property
    def cpu_capacity_bytes(self) -> int:
        return self.cpu_buffer.shape[0] * self.block_bytes

    @property
    def cpu_used_bytes(self) -> int:
        return len(self.cpu) * self.block_bytes

    def _pool_block(self, block: int) -> torch.Tensor:
        return self.kv_cache[:, :, block * self.block_size : (block + 1) * self.block_size]

    def save(self, block: int, h: bytes) -> None:
        """The pool is about to hand out `block`, cached under `h`: keep a copy in the CPU tier."""
        if h in self.cpu:
            self.cpu.move_to_end(h)
            return
        if not self.free_slots:
            self._spill(*self.cpu.popitem(last=False))
        entry = _CpuEntry(self.free_slots.pop())
        dst, src = self.cpu_buffer[entry.slot], self._pool_block(block)
        if self.cuda:
            # after the kernels that wrote the block (and any load still reading this slot)
            self.copy_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.copy_stream):
                dst.copy_(src, non_blocking=True)
                entry.copied = torch.cuda.Event()
                entry.copied.record()
        else:
            dst.copy_(src)
        entry.on_disk = self.disk is not None and h in self.disk
        if self.on_move is not None:
            self.on_move("save", block, entry.slot, h)
        if self.metadata_of is not None:
            entry.metadata = {k: v.cpu().clone() for k, v in self.metadata_of(block).items()}
        self.cpu[h] = entry
        self.stats.bytes_to_cpu += self.block_bytes

    def _spill(self, h: bytes, entry: _CpuEntry) -> None:
        if self.disk is not None and not entry.on_disk:
            if entry.copied is not None:
                entry.copied.synchronize()
            block = KVBlock(h, self.cpu_buffer[entry.slot], self.weight_generation, entry.metadata)
            written = self.disk.write(block)
            self.stats.bytes_to_disk += written
            if written and self.on_move is not None:
                self.on_move("spill", -1, entry.slot, h)
        self.free_slots.append(entry.slot)

    def where(self, h: bytes) -> str | None:
        """ "cpu", "disk" or None; a CPU hit becomes the most recently used."""
        if h in self.cpu:
            self.cpu.move_to_end(h)
            return "cpu"
        return "disk" if self.disk is not None and h in self.disk else None

    def count_queries(self, found: list[str | None]) -> None:
        """One admitted prompt's tier lookups, in order (`where` of each block looked up)."""
        self.stats.cpu_queries += len(found) * self.block_size
        if self.disk is not None:
            self.stats.disk_queries += sum(tier != "cpu" for tier in found) * self.block_size

    def load(self, h: bytes, block: int) -> bool:
        """Copy the block cached under `h` into pool block `block`; False when it has to be recomputed."""
        dst = self._pool_block(block)
        if self.cuda:  # the pool block may still be being copied out by an eviction this step
            torch.cuda.current_stream().wait_stream(self.copy_stream)
        entry = self.cpu.get(h)
        if entry is not None:
            if not self._restore(block, entry.metadata):
                return False
            dst.copy_(self.cpu_buffer[entry.slot], non_blocking=True)
            if self.on_move is not None:
                self.on_move("load", block, entry.slot, h)
            self.stats.bytes_from_cpu += self.block_bytes
            self.stats.cpu_hits += self.block_size
            return True
        if self.disk is None or h not in self.disk:
            return False
        found = self.disk.read(h, self.block_shape, self.kv_cache.dtype)
        if found is None:
            self.stats.disk_rejected += 1
            return False
        if not self._restore(block, found.metadata):
            return False
        dst.copy_(found.kv)
        if self.on_move is not None:
            self.on_move("load_disk", block, -1, h)
        self.stats.bytes_from_disk += self.block_bytes
        self.stats.disk_hits += self.block_size
        return True

    def _restore(self, block: int, metadata: dict[str, torch.Tensor]) -> bool:
        if not self.required_metadata <= metadata.keys():
            return False
        if self.restore_metadata is not None:
            self.restore_metadata(block, metadata)
        return True

    def before_run(self) -> None:
        """CUDA: the step's kernels may overwrite blocks being copied out; they wait on the GPU, not here."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.copy_stream)

    def clear(self, weight_generation: int | None = None) -> None:
        """Drop every block (the weights changed: none can match again) and delete the disk files."""
        if weight_generation is not None:
            self.weight_generation = weight_generation
            if self.on_move is not None:
                self.on_move("generation", -1, weight_generation, b"")
        self.free_slots.extend(e.slot for e in self.cpu.values())
        self.cpu.clear()
        if self.disk is not None:
            self.disk.clear()

    def close(self) -> None:
        self.clear()
        if self.disk is not None:
            self.disk.close()
