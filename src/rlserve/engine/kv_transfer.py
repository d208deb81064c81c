"""Prefill/decode disaggregation: a prefilled prompt's KV moves from the prefill server's pool to the decode server's.

Prefill side (P). A request whose `kv_transfer_params` say `do_remote_decode` keeps its full prompt
blocks pinned when it finishes; its output's `kv_transfer_params` say where they are (this server's
block server, a transfer id, the block ids and hashes). `BlockServer` serves them over TCP. The pin
ends when the pull's connection closes (pulled, failed or abandoned), when the request id is
aborted, or after `kv_transfer.pin_timeout_s`; ending a pin twice is harmless.

Decode side (D). A request with `do_remote_prefill` whose weight generation, block size, dtype and KV
shape match this engine's pulls the prompt blocks its own prefix cache lacks, in a thread. Between two
steps they are written into pool blocks registered under D's own chained hashes (each must equal the
hash P computed, so tokens, weights, adapter and cache_salt all agree) and held until the request is
admitted; the normal prefix-cache path then skips their prefill. Any mismatch or failure: the request
prefills locally (counted as a fallback).

Wire, one TCP connection per transfer; a frame is a u32 LE length + UTF-8 JSON (never pickle):
    D -> P  {"op": "pull", "transfer_id": T, "first": k, "count": n}  |  {"op": "release", "transfer_id": T}
    P -> D  {"ok": true, "blocks": m}, then m blocks, each a u64 LE length + engine/kv_format.py bytes
            |  {"ok": false, "error": "..."}
"""

from __future__ import annotations

import itertools
import json
import logging
import queue
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlserve.config import KVTransferConfig
from rlserve.engine import kv_format
from rlserve.engine.kv_cache import block_hash
from rlserve.engine.kv_format import KVBlock

if TYPE_CHECKING:
    from rlserve.engine.engine import Engine
    from rlserve.engine.sequence import Request, Sequence

log = logging.getLogger(__name__)

_MAX_FRAME = 1 << 20  # a JSON frame (requests, answers) is small
_BLOCK_SLACK = 1 << 20  # header + checksum room over a block's raw KV bytes
_SOCKET_BUFFER = 8 << 20  # several blocks in flight: hashing on one side overlaps copying on the other
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
_SPARE_RECEIVE_BYTES = 256 << 20  # receive buffers a decode server keeps between pulls
# how often an idle engine loop looks for landed pulls: waking every 1 ms took the GIL from the pulling
# thread often enough to cost ~40% of a lone pull's rate (measured: 0.86 -> 1.51 GB/s at 5 ms)
LANDING_POLL_S = 0.005


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        sock.setsockopt(socket.SOL_SOCKET, opt, _SOCKET_BUFFER)


class TransferError(RuntimeError):
    """The pull did not deliver usable blocks: the request prefills locally."""


# ---- framing --------------------------------------------------------------------------------


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack("<I", len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return buf


def recv_frame(sock: socket.socket) -> dict[str, Any]:
    (n,) = struct.unpack("<I", _recv_exact(sock, 4))
    if n > _MAX_FRAME:
        raise TransferError(f"frame of {n} bytes is larger than {_MAX_FRAME}")
    try:
        obj = json.loads(bytes(_recv_exact(sock, n)))
    except ValueError as e:
        raise TransferError(f"bad frame: {e}") from None
    if not isinstance(obj, dict):
        raise TransferError("bad frame: not a JSON object")
    return obj


def send_parts(sock: socket.socket, parts: list) -> int:
    """One block as kv_format.encode_parts made it: a u64 length, then the pieces, gathered by the kernel
    straight from their memory (the pool's own, on CPU) in as few sendmsg calls as it takes."""
    views = [v for v in (memoryview(p).cast("B") for p in parts) if v.nbytes]  # an empty one would never advance
    size = sum(v.nbytes for v in views)
    views.insert(0, memoryview(struct.pack("<Q", size)))
    first = 0
    while first < len(views):
        n = sock.sendmsg(views[first : first + _IOV_MAX])
        while n and n >= views[first].nbytes:  # a timeout socket may take part of the list
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]
    return size


def send_blocks(sock: socket.socket, blocks: Iterator[KVBlock]) -> int:
    """Bytes sent. Each block is hashed and then sent from its own memory on this thread: a helper thread
    hashing the next block measured slower (hand-offs and the GIL) than the hash itself."""
    return sum(send_parts(sock, kv_format.encode_parts(block)) for block in blocks)


def recv_block_bytes(sock: socket.socket, max_bytes: int, buffers: "ReceiveBuffers | None" = None) -> bytearray:
    (n,) = struct.unpack("<Q", _recv_exact(sock, 8))
    if n > max_bytes:
        raise TransferError(f"a block of {n} bytes is larger than this engine's blocks ({max_bytes})")
    if buffers is None:
        return _recv_exact(sock, n)
    buf = buffers.get(n)
    _recv_into(sock, memoryview(buf))
    return buf


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        # MSG_WAITALL: one call per block, not one per TCP segment (each return re-takes the GIL, which a
        # busy engine thread holds for up to the switch interval)
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k


class ReceiveBuffers:
    """Block-sized receive buffers kept for the next pull: a fresh buffer faults its pages in while the
    socket fills it, which measured ~3x slower than receiving into memory touched before."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.kept = max_bytes, 0
        self.free: dict[int, list[bytearray]] = {}
        self.lock = threading.Lock()

    def get(self, n: int) -> bytearray:
        with self.lock:
            spare = self.free.get(n)
            if spare:
                self.kept -= n
                return spare.pop()
        return bytearray(n)

    def put(self, bufs: list[bytearray]) -> None:
        with self.lock:
            for buf in bufs:
                if self.kept + len(buf) <= self.max_bytes:
                    self.free.setdefault(len(buf), []).append(buf)
                    self.kept += len(buf)


def decode_block(data: bytearray, shape: tuple[int, ...], dtype: torch.dtype) -> KVBlock:
    try:
        return kv_format.decode(data, expect_shape=shape, expect_dtype=dtype)
    except kv_format.BlockFormatError as e:
        raise TransferError(str(e)) from None


# ---- the prefill side's block server ----------------------------------------------------------


class BlockServer:
    """Accepts pulls on host:port, one thread per connection. `blocks(transfer_id, first, count)` yields
    the blocks (KeyError: unknown transfer); `done(transfer_id)` is called when the connection ends."""

    def __init__(self, host: str, port: int, blocks: Callable[[str, int, int], Iterator[KVBlock]],
                 done: Callable[[str, int, float], None], timeout_s: float):
        self.blocks, self.done, self.timeout_s = blocks, done, timeout_s
        self.sock = socket.create_server((host, port))
        self.port = self.sock.getsockname()[1]
        self.closed = False
        threading.Thread(target=self._accept, name="rlserve-kv-server", daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(conn,), name="rlserve-kv-serve", daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        tid, sent, start, blocks = None, 0, time.monotonic(), None
        with conn:
            try:
                conn.settimeout(self.timeout_s)
                _tune(conn)
                msg = recv_frame(conn)
                tid = str(msg.get("transfer_id"))
                if msg.get("op") == "pull":
                    blocks = self.blocks(tid, int(msg.get("first", 0)), int(msg.get("count", 0)))
                    try:
                        first = next(blocks, None)
                    except KeyError as e:
                        send_frame(conn, {"ok": False, "error": str(e.args[0]) if e.args else "unknown transfer"})
                        return
                    send_frame(conn, {"ok": True, "blocks": 0 if first is None else int(msg.get("count", 0))})
                    if first is not None:  # lazily: the pin counts as read until the last block is sent
                        sent = send_blocks(conn, itertools.chain([first], blocks))
                elif msg.get("op") != "release":
                    send_frame(conn, {"ok": False, "error": f"unknown op {msg.get('op')!r}"})
            except (OSError, TransferError, ValueError, TypeError) as e:
                log.warning("KV transfer %s: serving failed (%s); its blocks are released", tid, e)
            finally:
                if blocks is not None:
                    blocks.close()  # ends its read of the pin now, not at garbage collection
                if tid is not None:
                    self.done(tid, sent, time.monotonic() - start)

    def close(self) -> None:
        self.closed = True
        self.sock.close()


def pull(host: str, port: int, transfer_id: str, first: int, count: int, timeout_s: float,
         shape: tuple[int, ...], dtype: torch.dtype,
         buffers: ReceiveBuffers | None = None) -> tuple[list[KVBlock], int, list[bytearray]]:
    """The decode side: `count` blocks from index `first` of a transfer, the bytes read, and the buffers the
    blocks' tensors share (for `buffers.put` once the blocks are written elsewhere). Each block's checksum
    is checked on arrival, while the socket buffers the next ones."""
    max_bytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size() + _BLOCK_SLACK
    blocks, total, received = [], 0, []
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            _tune(sock)
            send_frame(sock, {"op": "pull", "transfer_id": transfer_id, "first": first, "count": count})
            head = recv_frame(sock)
            if not head.get("ok"):
                raise TransferError(f"the prefill server refused: {head.get('error')}")
            if head.get("blocks") != count:
                raise TransferError(f"the prefill server has {head.get('blocks')} of the {count} blocks asked for")
            for _ in range(count):
                data = recv_block_bytes(sock, max_bytes, buffers)
                received.append(data)
                total += len(data)
                blocks.append(decode_block(data, shape, dtype))
    except BaseException:
        if buffers is not None:
            buffers.put(received)
        raise
    return blocks, total, received


def release_remote(host: str, port: int, transfer_id: str, timeout_s: float) -> None:
    """Tell the prefill server its pin is not needed (best effort: its timeout frees it anyway)."""
    def send() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                send_frame(sock, {"op": "release", "transfer_id": transfer_id})
        except OSError as e:
            log.info("KV transfer %s: release not delivered (%s); the prefill server's timeout frees it", transfer_id, e)

    threading.Thread(target=send, name="rlserve-kv-release", daemon=True).start()


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
    serving: int = 0  # connections reading it now: the timeout waits for them


@dataclass(slots=True)
class _Landing:
    req: "Request"
    first: int
    blocks: list[KVBlock] | None = None
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0
    hashes: list[bytes] = field(default_factory=list)
    buffers: list[bytearray] = field(default_factory=list)  # the blocks' memory, reused once they are written


class KVTransfer:
    """Owned by the Engine; every method but the block server's callbacks runs in the engine's thread."""

    def __init__(self, engine: "Engine", config: KVTransferConfig):
        self.engine, self.config = engine, config
        self.pool, self.kv_cache = engine.pool, engine.runner.kv_cache
        layers, _, _, kv_heads, head_dim = self.kv_cache.shape
        self.block_size = engine.pool.block_size
        self.block_shape = (layers, 2, self.block_size, kv_heads, head_dim)
        self.stats = TransferStats()
        self.pins: dict[str, _Pin] = {}
        self.lock = threading.Lock()  # pins, shared with the block server's threads
        self.released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.landed: queue.SimpleQueue[_Landing] = queue.SimpleQueue()
        self.pulling = 0
        self.buffers = ReceiveBuffers(_SPARE_RECEIVE_BYTES)
        self.server = BlockServer(config.host, config.port, self._blocks, self._served, config.pull_timeout_s)
        self.engine_id = f"rlserve-{config.host}:{self.server.port}"

    @property
    def pinned_blocks(self) -> int:
        with self.lock:
            return sum(len(p.blocks) for p in self.pins.values())

    def close(self) -> None:
        self.server.close()

    # ---- prefill side ---------------------------------------------------------------------

    def pin(self, seq: "Sequence") -> None:
        """The request is finishing: keep its full prompt blocks for the decode server."""
        req = seq.request
        if req.kv_transfer_out is not None:  # n > 1: the samples share the prompt's blocks
            return
        n = min(len(seq.block_hashes), len(req.prompt_token_ids) // self.block_size)
        blocks, hashes = seq.block_table[:n], seq.block_hashes[:n]
        for b in blocks:
            self.pool.take(b)
        tid = uuid.uuid4().hex
        generation = self.engine.weight_generation
        with self.lock:
            self.pins[tid] = _Pin(req.request_id, blocks, hashes, generation,
                                  time.monotonic() + self.config.pin_timeout_s)
        self.stats.pinned += 1
        req.kv_transfer_out = {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
            "remote_host": self.config.host, "remote_port": self.server.port, "remote_block_ids": blocks,
            "remote_request_id": req.request_id, "transfer_id": tid, "block_hashes": [h.hex() for h in hashes],
            "block_size": self.block_size, "weight_generation": generation,
            "dtype": str(self.kv_cache.dtype).removeprefix("torch."), "kv_shape": list(self.block_shape),
        }

    def release_request(self, request_id: str) -> int:
        """An abort by id: free its pins (those being read are freed when their connection ends)."""
        with self.lock:
            tids = [t for t, p in self.pins.items() if p.request_id == request_id and not p.serving]
        for tid in tids:
            self._unpin(tid)
        return len(tids)

    def _blocks(self, tid: str, first: int, count: int) -> Iterator[KVBlock]:
        # block server thread: pinned blocks are never written or handed out, so reading them is safe
        with self.lock:
            pin = self.pins.get(tid)
            if pin is None:
                raise KeyError(f"transfer {tid} is unknown or already released (timeout {self.config.pin_timeout_s} s)")
            if first < 0 or count < 0 or first + count > len(pin.blocks):
                raise KeyError(f"blocks {first}..{first + count} are outside the transfer's {len(pin.blocks)}")
            pin.serving += 1
        try:
            bs, on_cpu = self.block_size, self.kv_cache.device.type == "cpu"
            # on CPU the pool's own memory is hashed and sent, no copy; off CPU one host staging block per
            # connection (send_blocks sends each block before it draws the next)
            staging = None if on_cpu else torch.empty(self.block_shape, dtype=self.kv_cache.dtype)
            for i in range(first, first + count):
                b = pin.blocks[i]
                kv = self.kv_cache[:, :, b * bs : (b + 1) * bs]
                if staging is not None:
                    kv = staging.copy_(kv)  # device to host: no host threads
                yield KVBlock(pin.hashes[i], kv, pin.weight_generation)
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

    def _unpin(self, tid: str) -> None:
        with self.lock:
            pin = self.pins.pop(tid, None)
        if pin is not None:
            for b in reversed(pin.blocks):
                self.pool.release(b)

    # ---- decode side ----------------------------------------------------------------------

    def start_pull(self, req: "Request") -> bool:
        """True when the request waits for pulled KV (it is scheduled once they land); False: run it now."""
        kt = req.params.kv_transfer_params
        if not kt or not kt.get("do_remote_prefill"):
            return False
        host, port, tid = kt.get("remote_host"), kt.get("remote_port"), kt.get("transfer_id")
        if not host or not isinstance(port, int) or not tid:
            log.info("request %s: kv_transfer_params without a transfer (%s); prefilling locally", req.request_id, kt)
            self.stats.fallbacks += 1
            return False
        if host not in self.config.peer_hosts:
            log.warning("request %s: kv_transfer_params.remote_host %r is not in kv_transfer.peer_hosts; prefilling "
                        "locally (add the prefill servers' hosts to kv_transfer.peer_hosts)", req.request_id, host)
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
        self.pulling += 1
        landing = _Landing(req, have)
        threading.Thread(target=self._pull, args=(landing, host, port, str(tid), wanted - have),
                         name="rlserve-kv-pull", daemon=True).start()
        return True

    def _mismatch(self, kt: dict[str, Any], req: "Request") -> str | None:
        e = self.engine
        if kt.get("weight_generation") != e.weight_generation:
            return f"weight_generation {kt.get('weight_generation')} differs from this server's {e.weight_generation}"
        if kt.get("block_size") != self.block_size:
            return f"block_size {kt.get('block_size')} differs from this server's {self.block_size}"
        if kt.get("dtype") != str(self.kv_cache.dtype).removeprefix("torch."):
            return f"dtype {kt.get('dtype')} differs from this server's {self.kv_cache.dtype}"
        if kt.get("kv_shape") != list(self.block_shape):
            return f"KV block shape {kt.get('kv_shape')} differs from this server's {list(self.block_shape)}"
        if e.runner.routing is not None:
            return "router replay needs each block's routed experts, which transfers do not carry"
        if req.params.prompt_logprobs is not None:
            return "prompt_logprobs need the whole prompt computed here"
        if not self.pool.enable_caching:
            return "prefix caching is off"
        return None

    def _hashes(self, req: "Request", n: int) -> list[bytes]:
        """This engine's chained prefix-cache hashes of the prompt's first n blocks."""
        extra, parent, out, bs = self.engine._cache_key(req), None, [], self.block_size
        for i in range(n):
            parent = block_hash(parent, req.prompt_token_ids[i * bs : (i + 1) * bs], extra)
            out.append(parent)
        return out

    def _pull(self, landing: _Landing, host: str, port: int, tid: str, count: int) -> None:
        start = time.monotonic()
        try:
            landing.blocks, landing.nbytes, landing.buffers = pull(
                host, port, tid, landing.first, count, self.config.pull_timeout_s, self.block_shape,
                self.kv_cache.dtype, self.buffers)
        except (OSError, TransferError) as e:
            landing.error = str(e) or type(e).__name__
        landing.seconds = time.monotonic() - start
        self.landed.put(landing)

    def _land(self, landing: _Landing) -> None:
        self.pulling -= 1
        req, s = landing.req, self.stats
        if landing.error is not None:
            log.warning("request %s: KV pull failed (%s); prefilling locally", req.request_id, landing.error)
            s.pull_failures += 1
            s.fallbacks += 1
        elif not req.finished:  # not aborted meanwhile
            s.bytes_in += landing.nbytes
            s.seconds_in += landing.seconds
            written = self._write(req, landing.first, landing.blocks or [])
            if written:
                s.pulls += 1
                s.tokens_in += written * self.block_size
            else:
                s.fallbacks += 1
        landing.blocks = None
        self.buffers.put(landing.buffers)  # written into the pool (or dropped): their memory serves the next pull
        if not req.finished:
            self.engine.scheduler.add(req.seqs[0])

    def _write(self, req: "Request", first: int, blocks: list[KVBlock]) -> int:
        """Hold the prompt's leading cached blocks and write the pulled ones after them; how many were written.
        Hashes are this engine's, under its current weights: KV from other weights never matches."""
        hashes = self._hashes(req, first + len(blocks))
        bs, held = self.block_size, req.held_blocks
        for h in hashes[:first]:
            b = self.pool.lookup(h)
            if b is None:  # evicted during the pull: the chain breaks here, the rest is recomputed
                return 0
            self.pool.take(b)
            held.append(b)
        written = 0
        for h, block in zip(hashes[first:], blocks):
            if block.block_hash != h or block.weight_generation != self.engine.weight_generation:
                log.info("request %s: a pulled block was computed for other tokens, weights or salt; prefilling "
                         "from there locally", req.request_id)
                break
            b = self.pool.lookup(h)
            if b is None:
                if self.pool.num_free == 0:
                    break
                b = self.pool.allocate()
                self.kv_cache[:, :, b * bs : (b + 1) * bs].copy_(block.kv)
                self.pool.register(b, h)
            else:
                self.pool.take(b)
            held.append(b)
            written += 1
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
            log.info("KV transfer %s: nobody pulled it within %s s; its blocks are freed", tid, self.config.pin_timeout_s)
            self.stats.expired += 1
            self._unpin(tid)
        while True:
            try:
                self._land(self.landed.get_nowait())
            except queue.Empty:
                break

    def release_held(self, req: "Request") -> None:
        for b in reversed(req.held_blocks):
            self.pool.release(b)
        req.held_blocks.clear()
