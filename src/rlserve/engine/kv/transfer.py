"""Prefill/decode disaggregation: a prefilled prompt's KV moves from the prefill server's pool to the decode server's.

Prefill side (P). A request whose `kv_transfer_params` say `do_remote_decode` keeps its full prompt
blocks pinned when it finishes; its output's `kv_transfer_params` say where they are (this server's
block server, a transfer id, the block ids and hashes). `BlockServer` serves them over TCP. The pin
ends when the pull's connection closes (pulled, failed or abandoned), when the request id is
aborted, or after `kv_transfer.pin_timeout_s`; ending a pin twice is harmless.

Decode side (D). A request with `do_remote_prefill` whose weight generation, block size, dtype and KV
shape match this engine's pulls the prompt blocks its own prefix cache lacks, in a thread, straight into
pool blocks reserved when the pull starts (checked there: header and checksum). The pull wakes the engine
loop; between two steps the blocks are registered under D's own chained hashes (each must equal the hash
P computed, so tokens, weights, adapter and cache_salt all agree) and held until the request is
admitted; the normal prefix-cache path then skips their prefill. Any mismatch or failure: the reserved
blocks are freed and the request prefills locally (counted as a fallback).

Per-block arrays an engine keeps beside its KV (router replay's routed experts, engine/routing.py) travel
with each block: P sends a pinned block's rows with its KV, D receives them straight into its own rows of
the reserved block. A D that keeps them pulls only from a P whose blocks carry them (its
`kv_transfer_params.block_metadata` says so); otherwise it prefills locally, never leaving zeros.

Under tensor parallelism the wire still carries whole blocks (every KV head), so servers of any tp pair up:
rank 0 gathers and scatters its workers' head slices (engine/tp/kv_transfer.py).

The wire and the prefill side's block server are engine/kv/wire.py.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlserve.config.schema import KVTransferConfig
from rlserve.engine.kv import format as kv_format
from rlserve.engine.kv.pool import block_hash
from rlserve.engine.kv.wire import BlockServer, TransferError, pull_into, release_remote

if TYPE_CHECKING:
    from rlserve.engine.kv.pool import BlockPool
    from rlserve.engine.scheduler import Scheduler
    from rlserve.engine.sequence import Request, Sequence
    from rlserve.engine.tp.kv_transfer import RankSlices

log = logging.getLogger(__name__)


def _metadata_specs(arrays: dict[str, torch.Tensor]) -> tuple[kv_format.MetadataSpec, ...]:
    for name, t in arrays.items():
        if t.device.type != "cpu" or not t.is_contiguous():  # a pull writes a block's rows in place
            raise ValueError(f"the per-block array {name!r} must be a contiguous CPU tensor to travel with the KV")
    return tuple(sorted(((name, tuple(t.shape), t.dtype) for name, t in arrays.items()), key=lambda m: m[0]))


def _metadata_json(metadata: tuple[kv_format.MetadataSpec, ...]) -> dict[str, dict]:
    return {name: {"shape": list(shape), "dtype": str(dtype).removeprefix("torch.")} for name, shape, dtype in metadata}


# ---- the engine's side of both ----------------------------------------------------------------


@dataclass(slots=True)
class TransferStats:
    pulls: int = 0  # transfers whose blocks reached this pool (decode side)
    pull_failures: int = 0  # pulls that failed (connection, refusal, bad block)
    fallbacks: int = 0  # remote-prefill requests that prefilled locally: a mismatch or a failure
    skipped: int = 0  # remote-prefill requests under non_cached_tokens (or fully cached): prefilled locally
    bytes_in: int = 0
    seconds_in: float = 0.0
    tokens_in: int = 0  # prompt tokens whose KV was pulled
    serves: int = 0  # pull connections served (prefill side)
    bytes_out: int = 0
    seconds_out: float = 0.0
    pinned: int = 0  # transfers pinned so far (prefill side)
    expired: int = 0  # pins freed by the timeout


@dataclass(slots=True)
class _Pin:
    request_id: str
    blocks: list[int]
    hashes: list[bytes]
    weight_generation: int
    deadline: float
    # each block's kv_format head and checksum, made at pin time on CPU pools (empty elsewhere: made at send time)
    heads: list[bytes]
    digests: list[bytes]
    serving: int = 0  # connections reading it now: the timeout waits for them
    whole: torch.Tensor | None = None  # tensor parallelism: every rank's slices put together at pin time


@dataclass(slots=True)
class _Landing:
    req: Request
    first: int  # leading prompt blocks this pool had cached: held in req.held_blocks from the start
    blocks: list[int]  # pool blocks reserved for the pulled ones; on CPU the pull writes them directly
    staging: list[torch.Tensor]  # off CPU: host blocks the pull writes, copied into `blocks` on landing
    start: float
    got: list[tuple[bytes, int]] = field(default_factory=list)  # each block's (hash, weight generation)
    error: str | None = None
    nbytes: int = 0


class KVTransfer:
    """Owned by the Engine; every method but the block server's callbacks runs in the engine's thread.

    It sees only what a transfer touches: the block pool and the KV tensor, the scheduler (a landed request
    goes back to it), the engine's prefix-cache key and its weight generation, and `block_metadata`: the
    per-block arrays (name -> a block's rows, block_size first) the engine keeps beside the KV, which travel
    with each block (router replay's routed experts)."""

    def __init__(
        self,
        config: KVTransferConfig,
        pool: BlockPool,
        kv_cache: torch.Tensor,
        scheduler: Scheduler,
        cache_key: Callable[[Request], bytes],
        weight_generation: Callable[[], int],
        block_metadata: Callable[[int], dict[str, torch.Tensor]] | None = None,
        ranks: RankSlices | None = None,
    ):
        self.config = config
        self.pool, self.kv_cache, self.scheduler = pool, kv_cache, scheduler
        self.cache_key, self.weight_generation = cache_key, weight_generation
        layers, _, _, kv_heads, head_dim = self.kv_cache.shape
        self.block_size = pool.block_size
        self.ranks = ranks  # tensor parallelism: this pool holds 1/tp of each block's heads, the wire all of them
        self.block_shape = (layers, 2, self.block_size, kv_heads * (ranks.tp if ranks else 1), head_dim)
        self.block_metadata = block_metadata or (lambda block: {})
        self.metadata = _metadata_specs(self.block_metadata(0))
        self.stats = TransferStats()
        self.pins: dict[str, _Pin] = {}
        self.lock = threading.Lock()  # pins, shared with the block server's threads
        self.released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.landed: queue.SimpleQueue[_Landing] = queue.SimpleQueue()
        self.pulling = 0
        self.wake: Callable[[], None] = lambda: None  # the engine loop's wakeup: a landed pull is handled at once
        cpu = ranks is None and self.kv_cache.device.type == "cpu" and self.kv_cache.is_contiguous()
        self.pool_blocks = kv_format.PoolBlocks(self.kv_cache, self.block_size) if cpu else None
        self.server = BlockServer(config.host, config.port, self._blocks, self._served, config.pull_timeout_s)
        self.engine_id = f"rlserve-{config.host}:{self.server.port}"

    @property
    def pinned_blocks(self) -> int:
        with self.lock:
            return sum(len(p.blocks) for p in self.pins.values())

    def close(self) -> None:
        self.server.close()

    # ---- prefill side ---------------------------------------------------------------------

    def pin(self, seq: Sequence) -> None:
        """The request is finishing: keep its full prompt blocks for the decode server."""
        req = seq.request
        if req.kv_transfer_out is not None:  # n > 1: the samples share the prompt's blocks
            return
        n = min(len(seq.block_hashes), len(req.prompt_token_ids) // self.block_size)
        blocks, hashes = seq.block_table[:n], seq.block_hashes[:n]
        for b in blocks:
            self.pool.take(b)
        tid = uuid.uuid4().hex
        generation = self.weight_generation()
        heads, digests = [], []
        if self.pool_blocks is not None:
            # hashed now, on the engine thread (~8 ms for a 1,024-token smollm2-135m prompt here, next to its
            # prefill's ~1 s), so that a pull only copies: pinned blocks are never written, so their checksum
            # holds until they are sent
            shape, dtype, md = self.block_shape, self.kv_cache.dtype, self.metadata
            heads = kv_format.kv_heads(hashes, generation, shape, dtype, md)
            digests = [
                kv_format.kv_parts(h, generation, shape, dtype, self._views(b, md), head, metadata=md)[-1]
                for b, h, head in zip(blocks, hashes, heads)
            ]
        whole = self.ranks.gather(blocks) if self.ranks is not None and blocks else None
        deadline = time.monotonic() + self.config.pin_timeout_s
        with self.lock:
            self.pins[tid] = _Pin(req.request_id, blocks, hashes, generation, deadline, heads, digests, whole=whole)
        self.stats.pinned += 1
        req.kv_transfer_out = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_host": self.config.host,
            "remote_port": self.server.port,
            "remote_block_ids": blocks,
            "remote_request_id": req.request_id,
            "transfer_id": tid,
            "block_hashes": [h.hex() for h in hashes],
            "block_size": self.block_size,
            "weight_generation": generation,
            "dtype": str(self.kv_cache.dtype).removeprefix("torch."),
            "kv_shape": list(self.block_shape),
            "block_metadata": _metadata_json(self.metadata),
        }

    def release_request(self, request_id: str) -> int:
        """An abort by id: free its pins (those being read are freed when their connection ends)."""
        with self.lock:
            tids = [t for t, p in self.pins.items() if p.request_id == request_id and not p.serving]
        for tid in tids:
            self._unpin(tid)
        return len(tids)

    def _views(self, block: int, metadata: tuple[kv_format.MetadataSpec, ...]) -> list[memoryview]:
        """A CPU pool block's KV runs (none off CPU), then the memory of its `metadata` arrays in name order."""
        arrays = self.block_metadata(block) if metadata else {}
        md = [v for name, _, _ in metadata for v in kv_format.tensor_views(arrays[name])]
        return [*(self.pool_blocks.views(block) if self.pool_blocks is not None else []), *md]

    def _blocks(self, tid: str, first: int, count: int, names: tuple[str, ...] = ()) -> Iterator[list]:
        # block server thread: pinned blocks are never written or handed out, so reading them is safe
        missing = sorted(set(names) - {m[0] for m in self.metadata})
        if missing:
            raise KeyError(f"this prefill server keeps no {missing} per block (router replay is off here)")
        metadata = tuple(m for m in self.metadata if m[0] in names)
        with self.lock:
            pin = self.pins.get(tid)
            if pin is None:
                raise KeyError(f"transfer {tid} is unknown or already released (timeout {self.config.pin_timeout_s} s)")
            if first < 0 or count < 0 or first + count > len(pin.blocks):
                raise KeyError(f"blocks {first}..{first + count} are outside the transfer's {len(pin.blocks)}")
            pin.serving += 1
        try:
            bs, shape, dtype = self.block_size, self.block_shape, self.kv_cache.dtype
            # on CPU the pool's own memory is sent, no copy, with the head and checksum made at pin time; off
            # CPU a host copy of each block, hashed here (send_blocks may hold several before sending). The
            # pin-time head and checksum cover every per-block array this server keeps: a D asking for fewer
            # gets them made here
            made = self.pool_blocks is not None and metadata == self.metadata
            for i in range(first, first + count):
                b = pin.blocks[i]
                if self.pool_blocks is not None:
                    views = self._views(b, metadata)
                else:  # device to host (no host threads), or the whole block tensor parallelism gathered
                    host = (
                        pin.whole[i] if pin.whole is not None else self.kv_cache[:, :, b * bs : (b + 1) * bs].to("cpu")
                    )
                    views = kv_format.tensor_views(host) + self._views(b, metadata)
                yield kv_format.kv_parts(
                    pin.hashes[i],
                    pin.weight_generation,
                    shape,
                    dtype,
                    views,
                    pin.heads[i] if made else None,
                    pin.digests[i] if made else None,
                    metadata,
                )
        finally:
            with self.lock:
                pin.serving -= 1

    def _served(self, tid: str, nbytes: int, seconds: float) -> None:
        # block server thread: the connection is over, whatever happened; the engine thread unpins
        if nbytes:
            with self.lock:  # several connections may end at once
                self.stats.serves += 1
                self.stats.bytes_out += nbytes
                self.stats.seconds_out += seconds
        self.released.put(tid)
        self.wake()

    def _unpin(self, tid: str) -> None:
        with self.lock:
            pin = self.pins.pop(tid, None)
        if pin is not None:
            for b in reversed(pin.blocks):
                self.pool.release(b)

    # ---- decode side ----------------------------------------------------------------------

    def start_pull(self, req: Request) -> bool:
        """True when the request waits for pulled KV (it is scheduled once they land); False: run it now."""
        start = time.monotonic()
        kt = req.params.kv_transfer_params
        if not kt or not kt.get("do_remote_prefill"):
            return False
        host, port, tid = kt.get("remote_host"), kt.get("remote_port"), kt.get("transfer_id")
        if not host or not isinstance(port, int) or not tid:
            log.info("request %s: kv_transfer_params without a transfer (%s); prefilling locally", req.request_id, kt)
            self.stats.fallbacks += 1
            return False
        if host not in self.config.peer_hosts:
            log.warning(
                "request %s: kv_transfer_params.remote_host %r is not in kv_transfer.peer_hosts; prefilling "
                "locally (add the prefill servers' hosts to kv_transfer.peer_hosts)",
                req.request_id,
                host,
            )
            self.stats.fallbacks += 1
            return False
        mismatch = self._mismatch(kt, req)
        if mismatch is not None:
            log.info("request %s: not using the prefill server's KV (%s); prefilling locally", req.request_id, mismatch)
            self.stats.fallbacks += 1
            release_remote(host, port, str(tid), self.config.pull_timeout_s)
            return False
        remote = len(kt.get("block_hashes") or [])
        wanted = min(remote, (len(req.prompt_token_ids) - 1) // self.block_size)
        hashes = self._hashes(req, wanted)
        have = 0
        while have < wanted and self.pool.lookup(hashes[have]) is not None:
            have += 1
        uncached = len(req.prompt_token_ids) - have * self.block_size
        if have == wanted or uncached < self.config.non_cached_tokens:
            self.stats.skipped += 1
            release_remote(host, port, str(tid), self.config.pull_timeout_s)
            return False
        for h in hashes[:have]:  # held until admission: the pulled blocks continue their chain
            b = self.pool.lookup(h)
            self.pool.take(b)
            req.held_blocks.append(b)
        count = min(wanted - have, self.pool.num_free)
        if count == 0:
            log.info("request %s: no free KV blocks to pull into; prefilling locally", req.request_id)
            self.release_held(req)
            self.stats.fallbacks += 1
            release_remote(host, port, str(tid), self.config.pull_timeout_s)
            return False
        # the destination blocks are reserved now and the pull writes their memory itself: landing is only
        # registering their hashes
        blocks = [self.pool.allocate() for _ in range(count)]
        self.pulling += 1
        landing = _Landing(req, have, blocks, [], start)
        threading.Thread(
            target=self._pull,
            args=(landing, host, port, str(tid), hashes[have : have + count], self.weight_generation()),
            name="rlserve-kv-pull",
            daemon=True,
        ).start()
        return True

    def _mismatch(self, kt: dict[str, Any], req: Request) -> str | None:
        generation = self.weight_generation()
        if kt.get("weight_generation") != generation:
            return f"weight_generation {kt.get('weight_generation')} differs from this server's {generation}"
        if kt.get("block_size") != self.block_size:
            return f"block_size {kt.get('block_size')} differs from this server's {self.block_size}"
        if kt.get("dtype") != str(self.kv_cache.dtype).removeprefix("torch."):
            return f"dtype {kt.get('dtype')} differs from this server's {self.kv_cache.dtype}"
        if kt.get("kv_shape") != list(self.block_shape):
            return f"KV block shape {kt.get('kv_shape')} differs from this server's {list(self.block_shape)}"
        carried = kt.get("block_metadata") or {}
        for name, spec in _metadata_json(self.metadata).items():
            if name not in carried:
                return (
                    f"its blocks carry no {name}, which this server keeps per block (router replay): "
                    "set enable_return_routed_experts on the prefill servers too"
                )
            if carried[name] != spec:
                return f"its blocks' {name} {carried[name]} differ from this server's {spec}"
        if req.params.prompt_logprobs is not None:
            return "prompt_logprobs need the whole prompt computed here"
        if not self.pool.enable_caching:
            return "prefix caching is off"
        return None

    def _hashes(self, req: Request, n: int) -> list[bytes]:
        """This engine's chained prefix-cache hashes of the prompt's first n blocks."""
        extra, parent, out, bs = self.cache_key(req), None, [], self.block_size
        for i in range(n):
            parent = block_hash(parent, req.prompt_token_ids[i * bs : (i + 1) * bs], extra)
            out.append(parent)
        return out

    def _pull(self, landing: _Landing, host: str, port: int, tid: str, hashes: list[bytes], generation: int) -> None:
        shape, dtype = self.block_shape, self.kv_cache.dtype

        md = self.metadata

        def destinations():  # the reserved blocks' memory (KV, then their arrays) and the heads expected before it
            if self.pool_blocks is not None:
                targets = [self._views(b, md) for b in landing.blocks]
            else:
                landing.staging = [torch.empty(shape, dtype=dtype) for _ in landing.blocks]
                targets = [
                    kv_format.tensor_views(t) + self._views(b, md) for t, b in zip(landing.staging, landing.blocks)
                ]
            heads = kv_format.kv_heads(hashes, generation, shape, dtype, md)
            return targets, [(head, h, generation) for head, h in zip(heads, hashes)]

        try:
            landing.got, landing.nbytes = pull_into(
                host,
                port,
                tid,
                landing.first,
                len(landing.blocks),
                destinations,
                self.config.pull_timeout_s,
                shape,
                dtype,
                md,
            )
        except (OSError, TransferError) as e:
            landing.error = str(e) or type(e).__name__
        self.landed.put(landing)
        self.wake()

    def _land(self, landing: _Landing) -> None:
        self.pulling -= 1
        req, s = landing.req, self.stats
        written = 0
        if landing.error is not None:
            log.warning("request %s: KV pull failed (%s); prefilling locally", req.request_id, landing.error)
            s.pull_failures += 1
            s.fallbacks += 1
        elif not req.finished:  # not aborted meanwhile
            written = self._register(req, landing)
            if written:
                s.pulls += 1
                s.tokens_in += written * self.block_size
                s.bytes_in += landing.nbytes
                # from the request's arrival to its blocks usable in this pool: what a pull costs the request
                s.seconds_in += time.monotonic() - landing.start
            else:
                s.fallbacks += 1
        for b in reversed(landing.blocks[written:]):  # not filled, or not usable: free again
            self.pool.release(b)
        if not req.finished:
            self.scheduler.add(req.seqs[0])

    def _register(self, req: Request, landing: _Landing) -> int:
        """Enter the pulled blocks into the prefix cache after the request's held ones; how many.
        Hashes are this engine's, under its current weights: KV from other weights never matches."""
        hashes = self._hashes(req, landing.first + len(landing.got))
        if any(self.pool.lookup(h) != b for h, b in zip(hashes, req.held_blocks)):
            log.info(
                "request %s: its cached prefix changed during the pull (new weights?); prefilling locally",
                req.request_id,
            )
            return 0
        written, bs, writes = 0, self.block_size, []
        for h, (got_hash, generation), b in zip(hashes[landing.first :], landing.got, landing.blocks):
            if got_hash != h or generation != self.weight_generation():
                log.info(
                    "request %s: a pulled block was computed for other tokens, weights or salt; prefilling "
                    "from there locally",
                    req.request_id,
                )
                break
            cached = self.pool.lookup(h)
            if cached is None:
                if landing.staging:
                    writes.append((b, landing.staging[written]))
                self.pool.register(b, h)
                req.held_blocks.append(b)
            else:  # computed here meanwhile: use that one
                self.pool.take(cached)
                req.held_blocks.append(cached)
                self.pool.release(b)
            written += 1
        if self.ranks is not None:  # every rank's heads, before the next step can read them
            self.ranks.write([b for b, _ in writes], [t for _, t in writes])
        else:
            for b, t in writes:
                self.kv_cache[:, :, b * bs : (b + 1) * bs].copy_(t)
        return written

    # ---- between two steps ----------------------------------------------------------------

    @property
    def busy(self) -> bool:
        """Pulls in flight: the step loop should look at them soon."""
        return self.pulling > 0

    def poll(self) -> None:
        while True:
            try:
                self._unpin(self.released.get_nowait())
            except queue.Empty:
                break
        now = time.monotonic()
        with self.lock:
            expired = [t for t, p in self.pins.items() if p.deadline < now and not p.serving]
        for tid in expired:
            log.info(
                "KV transfer %s: nobody pulled it within %s s; its blocks are freed", tid, self.config.pin_timeout_s
            )
            self.stats.expired += 1
            self._unpin(tid)
        while True:
            try:
                self._land(self.landed.get_nowait())
            except queue.Empty:
                break

    def release_held(self, req: Request) -> None:
        for b in reversed(req.held_blocks):
            self.pool.release(b)
        req.held_blocks.clear()
