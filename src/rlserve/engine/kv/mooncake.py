"""KV offload into a Mooncake distributed store shared by every replica (kv_cache_offload.type = "mooncake").

The same interface as engine/kv_offload.py's KVOffload (the pool saves a cached block it is about to hand
out again; a prefix that misses the pool is looked up here, block by block), but the blocks go to one store
that every replica contributes `cpu.num_bytes` of DRAM to, so a prefix one replica computed is loaded by
another. A block's key names the model, its KV shape and dtype, the weights (label and generation), the
rank (0: under tensor parallelism rank 0 stores whole blocks, engine/tp/kv_transfer.py) and the chained
prefix-cache hash (which already folds in the weights generation, adapter and cache_salt); its value is
kv_format's checksummed block, checked on load against the hash, shape, dtype and generation asked for.
So no block crosses a weight update or another model.

The store is best effort: when it fails (its master gone, a timeout), offload turns off with one warning
and the engine recomputes what it would have loaded; a full store just skips the block.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlserve.config.schema import KVMooncakeConfig, KVOffloadConfig
from rlserve.engine.kv import format as kv_format
from rlserve.engine.kv.format import BlockFormatError, KVBlock

if TYPE_CHECKING:
    from rlserve.engine.tp.kv_transfer import RankSlices

log = logging.getLogger(__name__)

TIER = "mooncake"
MIN_SEGMENT_BYTES = 16 << 20  # the store refuses smaller segments
_LOCAL_BUFFER_BYTES = 16 << 20  # the client's staging buffer for put/get (the library's default)
_FETCHED_BLOCKS = 256  # blocks fetched by lookups and not yet loaded (an admission that waits drops them)
_RPC_FAIL = -900  # the store's code when its master cannot be reached


class MooncakeUnavailable(RuntimeError):
    """The mooncake package or a library it needs cannot be loaded here."""


def import_store() -> type:
    """MooncakeDistributedStore, or MooncakeUnavailable saying what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:  # the wheel links libibverbs and libnuma even for TCP
        hint = (
            "pip install 'rlserve[mooncake]'"
            if isinstance(e, ModuleNotFoundError)
            else "apt-get install -y libibverbs1 librdmacm1 libnuma1"
        )
        raise MooncakeUnavailable(
            f"kv_cache_offload.type = 'mooncake' cannot load the Mooncake store ({e}): {hint}"
        ) from None
    return MooncakeDistributedStore


def metadata_url(mc: KVMooncakeConfig) -> str:
    """The configured URL, or the master's own HTTP metadata server on its default port."""
    if mc.metadata_server:
        return mc.metadata_server
    host = (mc.master_address or "").rpartition(":")[0]
    return f"http://{host}:8080/metadata"


@dataclass(slots=True)
class MooncakeStats:
    mooncake_queries: int = 0  # prompt tokens looked up in the store (after missing the pool)
    mooncake_hits: int = 0  # of which loaded from it
    mooncake_rejected: int = 0  # blocks that failed their checksum, shape or generation check (recomputed)
    mooncake_put_skipped: int = 0  # blocks the store had no room for
    bytes_to_mooncake: int = 0
    bytes_from_mooncake: int = 0
    mooncake_load_seconds: float = 0.0  # store -> pool, summed over loaded blocks


class KVMooncake:
    def __init__(
        self,
        config: KVOffloadConfig,
        kv_cache: torch.Tensor,
        block_size: int,
        model_name: str,
        weights: Callable[[], str],
        rank: int = 0,
        ranks: RankSlices | None = None,
    ):
        mc = config.mooncake or KVMooncakeConfig()
        if not mc.master_address:
            raise ValueError(
                "kv_cache_offload.type = 'mooncake' has no store address: `rlserve serve` starts a "
                "master and fills it in; elsewhere set kv_cache_offload.mooncake.master_address"
            )
        if kv_cache.device.type != "cpu":
            raise ValueError(
                "kv_cache_offload.type = 'mooncake' runs on the CPU engine only so far: use type = 'native'"
            )
        self.kv_cache, self.block_size = kv_cache, block_size
        # tensor parallelism: the store keeps whole blocks (every rank's heads), so replicas of any tp share them
        self.ranks, tp = ranks, ranks.tp if ranks is not None else 1
        layers, _, _, kv_heads, head_dim = kv_cache.shape
        self.block_shape = (layers, 2, block_size, kv_heads * tp, head_dim)
        self.block_bytes = kv_cache[:, :, :block_size].numel() * kv_cache.element_size() * tp
        if config.cpu.num_bytes < max(MIN_SEGMENT_BYTES, self.block_bytes):
            raise ValueError(
                f"kv_cache_offload.cpu.num_bytes ({config.cpu.num_bytes}) is below what a replica can "
                f"contribute to the Mooncake store (16 MiB, and at least one {self.block_bytes}-byte "
                "KV block): raise it"
            )
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        self._prefix = f"rlserve-kv/{model_name}/{dtype}x{'x'.join(map(str, self.block_shape))}"
        self._weights, self.rank = weights, rank
        self.weight_generation = 0
        self.capacity_bytes = config.cpu.num_bytes
        self.stats = MooncakeStats()
        self.metadata_of: Callable[[int], dict[str, torch.Tensor]] | None = None
        self.restore_metadata: Callable[[int, dict[str, torch.Tensor]], None] | None = None
        self.required_metadata: frozenset[str] = frozenset()
        self.disk = None  # the store's disk (its master's root_fs_dir, deploy/mooncake.py) is the master's to account
        # put by this replica under the current weights (not put again), as many as its own share holds
        self._saved: OrderedDict[bytes, None] = OrderedDict()
        self._saved_cap = config.cpu.num_bytes // self.block_bytes
        # a lookup fetches the block (one round trip, not two): the load that follows it takes it from here
        self._fetched: OrderedDict[bytes, bytes] = OrderedDict()
        store_class = import_store()
        self.store = store_class()
        rc = self.store.setup(
            mc.local_hostname,
            metadata_url(mc),
            config.cpu.num_bytes,
            max(_LOCAL_BUFFER_BYTES, 2 * (self.block_bytes + 65536)),
            mc.protocol,
            "",
            mc.master_address,
        )
        if rc != 0:
            raise ValueError(
                f"the Mooncake store at {mc.master_address} (metadata {metadata_url(mc)}) refused this "
                f"client (setup returned {rc}): check that its master runs and the addresses"
            )
        self.enabled = True
        log.info(
            "KV offload: Mooncake store at %s, this replica contributes %d bytes",
            mc.master_address,
            config.cpu.num_bytes,
        )

    # the KVOffload surface the engine and its stats read
    @property
    def cpu_capacity_bytes(self) -> int:
        return self.capacity_bytes

    @property
    def cpu_used_bytes(self) -> int:
        return len(self._saved) * self.block_bytes  # written by this replica; the master may have evicted some

    def key(self, h: bytes) -> str:
        return f"{self._prefix}/{self._weights()}/g{self.weight_generation}/r{self.rank}/{h.hex()}"

    def _pool_block(self, block: int) -> torch.Tensor:
        return self.kv_cache[:, :, block * self.block_size : (block + 1) * self.block_size]

    def _failed(self, what: str, rc) -> None:
        self.enabled = False
        log.warning(
            "KV offload to the Mooncake store is off: %s failed (%s); serving goes on, recomputing what "
            "it would have loaded",
            what,
            rc,
        )

    def save(self, block: int, h: bytes) -> None:
        """The pool is about to hand out `block`, cached under `h`: put it into the store."""
        if not self.enabled or h in self._saved:
            return
        metadata = {k: v.cpu().clone() for k, v in self.metadata_of(block).items()} if self.metadata_of else {}
        kv = self.ranks.gather([block])[0] if self.ranks is not None else self._pool_block(block)
        parts = kv_format.encode_parts(KVBlock(h, kv, self.weight_generation, metadata))
        try:
            rc = self.store.put_parts(self.key(h), *parts)
        except Exception as e:  # noqa: BLE001 - any store error turns offload off, never the engine
            return self._failed("put", e)
        if rc == _RPC_FAIL:
            return self._failed("put", rc)
        if rc != 0:  # no room (nothing evictable yet) or already there: the block is simply not kept
            self.stats.mooncake_put_skipped += 1
            return
        self._saved[h] = None
        if len(self._saved) > self._saved_cap:
            self._saved.popitem(last=False)
        self.stats.bytes_to_mooncake += sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)

    def where(self, h: bytes) -> str | None:
        if not self.enabled:
            return None
        start = time.perf_counter()
        data = self._get(h)
        if not data:
            return None
        self._fetched[h] = data
        if len(self._fetched) > _FETCHED_BLOCKS:
            self._fetched.popitem(last=False)
        self.stats.mooncake_load_seconds += time.perf_counter() - start
        return TIER

    def _get(self, h: bytes) -> bytes:
        """The stored block's bytes; empty when the store has none (or failed: offload then turns off)."""
        try:
            data = self.store.get(self.key(h))
            missing = self.store.is_exist(self.key(h)) if not data else 1  # a miss, or is the master gone?
        except Exception as e:  # noqa: BLE001
            self._failed("get", e)
            return b""
        if missing < 0:
            self._failed("get", missing)
        return data

    def count_queries(self, found: list[str | None]) -> None:
        self.stats.mooncake_queries += len(found) * self.block_size

    def load(self, h: bytes, block: int) -> bool:
        """Copy the block stored under `h` into pool block `block`; False when it has to be recomputed."""
        if not self.enabled:
            return False
        start = time.perf_counter()
        data = self._fetched.pop(h, None) or self._get(h)
        if not data:  # evicted since the lookup, or the store is gone
            return False
        try:
            found = kv_format.decode(
                data, expect_hash=h, expect_shape=self.block_shape, expect_dtype=self.kv_cache.dtype
            )
            if found.weight_generation != self.weight_generation:
                raise BlockFormatError(
                    f"weight generation {found.weight_generation}, expected {self.weight_generation}"
                )
        except BlockFormatError as e:
            log.warning("KV block %s from the Mooncake store is unusable (%s): recomputing it", h.hex()[:16], e)
            self.stats.mooncake_rejected += 1
            return False
        if not self.required_metadata <= found.metadata.keys():
            return False
        if self.restore_metadata is not None:
            self.restore_metadata(block, found.metadata)
        if self.ranks is not None:  # every rank's heads, before the step that reads them
            self.ranks.write([block], [found.kv])
        else:
            self._pool_block(block).copy_(found.kv)
        self.stats.bytes_from_mooncake += len(data)
        self.stats.mooncake_hits += self.block_size
        self.stats.mooncake_load_seconds += time.perf_counter() - start
        return True

    def before_run(self) -> None:
        pass

    def clear(self, weight_generation: int | None = None) -> None:
        """New weights: later keys carry the new generation, so nothing stored before can match. The old
        blocks stay in the store until its master evicts them (other replicas may still be on those weights)."""
        if weight_generation is not None:
            self.weight_generation = weight_generation
        self._saved.clear()
        self._fetched.clear()

    def close(self) -> None:
        if self.store is not None:
            if self.enabled:  # with its master gone the client's close waits out its retries (~10 s)
                self.store.close()
            self.store = None
