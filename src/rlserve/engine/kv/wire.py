"""The prefill/decode KV wire: one TCP connection per transfer, JSON frames (a u32 LE length + UTF-8 JSON, never
pickle), then raw blocks in engine/kv/format.py's layout, received straight into pool memory; and the prefill
side's BlockServer that answers pulls. The engine's side of a transfer is engine/kv/transfer.py.

    D -> P  {"op": "pull", "transfer_id": T, "first": k, "count": n, "metadata": [names]}
            |  {"op": "release", "transfer_id": T}
    P -> D  {"ok": true, "blocks": m}, then m blocks, each a u64 LE length + engine/kv/format.py bytes
            |  {"ok": false, "error": "..."}

`metadata` names the per-block arrays D keeps beside its KV (router replay's routed experts) and wants with
each block; P refuses a pull for one it does not keep."""

from __future__ import annotations

import itertools
import json
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from rlserve.engine.kv import format as kv_format

log = logging.getLogger(__name__)

_MAX_FRAME = 1 << 20  # a JSON frame (requests, answers) is small
_SOCKET_BUFFER = 8 << 20  # several blocks in flight: hashing on one side overlaps copying on the other
_IOV_MAX = 512  # buffers per sendmsg (Linux allows 1024)
# bytes received per recvmsg before their checksums are taken: little enough to still be in the core's L2
# (a 46.5 MB pull: 2-4 ms of checksums instead of 5-7 when they re-read 11 MB groups from memory)
_CHECK_BYTES = 512 << 10


def tune_socket(sock: socket.socket, timeout_s: float) -> None:
    """Blocking, with the timeout in the kernel (SO_RCVTIMEO/SO_SNDTIMEO): Python's own socket timeout makes
    the socket non-blocking, so MSG_WAITALL returns whatever has arrived and each call polls first (more
    system calls and GIL hand-offs per block: py-spy showed both sides waiting in poll)."""
    sock.settimeout(None)
    whole = int(timeout_s)
    timeval = struct.pack("ll", whole, int((timeout_s - whole) * 1e6))
    for opt in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
        sock.setsockopt(socket.SOL_SOCKET, opt, timeval)
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


def _send_views(sock: socket.socket, views: list) -> None:
    """Send byte buffers (bytes, or 1-D memoryviews of bytes: len is their size) in order."""
    first = 0
    while first < len(views):
        n = sock.sendmsg(views[first : first + _IOV_MAX])
        while n and n >= len(views[first]):  # a send interrupted (timeout, signal) takes part of the list
            n -= len(views[first])
            first += 1
        if n:
            views[first] = memoryview(views[first])[n:]


def send_blocks(sock: socket.socket, blocks: Iterator[list]) -> int:
    """Bytes sent of blocks given as kv_format.kv_parts (bytes and 1-D byte views, none empty), each a u64
    length and then its parts, gathered by the kernel straight from their memory (the pool's own, on CPU),
    several blocks per sendmsg. A block's memory must stay as it is after the generator moved on."""
    total, batch = 0, []
    for parts in blocks:
        size = sum(map(len, parts))
        batch.append(struct.pack("<Q", size))
        batch += parts
        total += 8 + size
        if len(batch) > _IOV_MAX - len(parts):
            _send_views(sock, batch)
            batch = []
    _send_views(sock, batch)
    return total


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, view.nbytes
    while got < n:
        # MSG_WAITALL: one call per block, not one per TCP segment (each return re-takes the GIL, which a
        # busy engine thread holds for up to the switch interval)
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            raise TransferError(f"connection closed after {got} of {n} bytes")
        got += k


def _recv_views(sock: socket.socket, views: list[memoryview]) -> None:
    """Fill the views in order, scattered by the kernel (recvmsg_into) in as few calls as it takes."""
    views, first = list(views), 0
    while first < len(views):
        n = sock.recvmsg_into(views[first : first + _IOV_MAX], 0, socket.MSG_WAITALL)[0]
        if n == 0:
            raise TransferError("connection closed in the middle of a block")
        while n and n >= views[first].nbytes:
            n -= views[first].nbytes
            first += 1
        if n:
            views[first] = views[first][n:]


def recv_blocks_into(
    sock: socket.socket,
    targets: list[list[memoryview]],
    heads: list[tuple[bytes, bytes, int]],
    shape: tuple[int, ...],
    dtype: torch.dtype,
    metadata: tuple[kv_format.MetadataSpec, ...] = (),
) -> tuple[list[tuple[bytes, int]], int]:
    """Blocks written straight into `targets` (each a destination pool block's per-layer k/v runs, then its
    `metadata` arrays' memory in name order), a group of _CHECK_BYTES (at least one block) per recvmsg_into,
    and each block's checksum checked on them there while they are in cache; each block's (hash, weight generation) and the bytes read. `heads`: the
    kv_format.kv_head each block should have, with the hash and weight generation in it (this engine's for
    the block): one that differs in content is parsed (a block for other tokens or weights: the caller stops
    there), one that differs in length ends the pull. On any error the targets hold garbage: the caller
    frees them."""
    payload_bytes = sum(v.nbytes for v in targets[0]) if targets else 0
    got, total, i = [], 0, 0
    while i < len(targets):
        group, iov = [], []
        while i < len(targets) and len(iov) + len(targets[i]) + 3 <= _IOV_MAX:
            if group and (len(group) + 1) * payload_bytes > _CHECK_BYTES:
                break
            size, head, digest = bytearray(8), bytearray(len(heads[i][0])), bytearray(kv_format.CHECKSUM_BYTES)
            group.append((size, head, digest, targets[i], heads[i]))
            iov += [memoryview(size), memoryview(head), *targets[i], memoryview(digest)]
            i += 1
        if not group:
            raise TransferError(f"a block of {len(targets[i])} runs does not fit one receive")
        _recv_views(sock, iov)
        for size, head, digest, views, expected in group:
            (n,) = struct.unpack("<Q", size)
            try:
                if n != len(expected[0]) + payload_bytes + kv_format.CHECKSUM_BYTES:
                    raise kv_format.BlockFormatError(
                        f"a block of {n} bytes, expected one of {payload_bytes} bytes of KV"
                        + (f" and {[m[0] for m in metadata]}" if metadata else "")
                    )
                if head == expected[0]:
                    block_hash, generation = expected[1:]
                elif kv_format.header_length(head) + kv_format.PREFIX_BYTES != len(head):
                    raise kv_format.BlockFormatError("a block's header is not the size this engine's is")
                else:
                    block_hash, generation = kv_format.layout_header(
                        head[kv_format.PREFIX_BYTES :], shape, dtype, metadata
                    )
            except kv_format.BlockFormatError as e:
                raise TransferError(str(e)) from None
            h = kv_format.checksum(head)
            for v in views:
                h.update(v)
            if h.digest() != digest:
                raise TransferError("checksum mismatch: a block arrived truncated or corrupted")
            got.append((block_hash, generation))
            total += 8 + n
    return got, total


# ---- the prefill side's block server ----------------------------------------------------------


class BlockServer:
    """Accepts pulls on host:port, one thread per connection. `blocks(transfer_id, first, count, metadata)`
    yields the blocks as kv_format.kv_parts with those per-block arrays (KeyError: unknown transfer, or an
    array it does not keep); `done(transfer_id)` is called when the connection ends."""

    def __init__(
        self,
        host: str,
        port: int,
        blocks: Callable[[str, int, int, tuple[str, ...]], Iterator[list]],
        done: Callable[[str, int, float], None],
        timeout_s: float,
    ):
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
                tune_socket(conn, self.timeout_s)
                msg = recv_frame(conn)
                tid = str(msg.get("transfer_id"))
                if msg.get("op") == "pull":
                    names = msg.get("metadata") or []
                    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                        send_frame(conn, {"ok": False, "error": "metadata must be a list of names"})
                        return
                    blocks = self.blocks(tid, int(msg.get("first", 0)), int(msg.get("count", 0)), tuple(names))
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


def pull_into(
    host: str,
    port: int,
    transfer_id: str,
    first: int,
    count: int,
    destinations: Callable[[], tuple[list[list[memoryview]], list[tuple[bytes, bytes, int]]]],
    timeout_s: float,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    metadata: tuple[kv_format.MetadataSpec, ...] = (),
) -> tuple[list[tuple[bytes, int]], int]:
    """The decode side: blocks `first`.. `first + count` of a transfer with their `metadata` arrays, one into
    each of the targets that `destinations()` gives with their expected heads (recv_blocks_into). It is called once the pull is asked
    for: making the views overlaps the prefill server's start, whose first blocks wait in the socket buffer."""
    with socket.create_connection((host, port), timeout=timeout_s) as sock:
        tune_socket(sock, timeout_s)
        names = sorted(m[0] for m in metadata)
        send_frame(sock, {"op": "pull", "transfer_id": transfer_id, "first": first, "count": count, "metadata": names})
        targets, heads = destinations()
        head = recv_frame(sock)
        if not head.get("ok"):
            raise TransferError(f"the prefill server refused: {head.get('error')}")
        if head.get("blocks") != count:
            raise TransferError(f"the prefill server has {head.get('blocks')} of the {count} blocks asked for")
        return recv_blocks_into(sock, targets, heads, shape, dtype, metadata)


def release_remote(host: str, port: int, transfer_id: str, timeout_s: float) -> None:
    """Tell the prefill server its pin is not needed (best effort: its timeout frees it anyway)."""

    def send() -> None:
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as sock:
                send_frame(sock, {"op": "release", "transfer_id": transfer_id})
        except OSError as e:
            log.info(
                "KV transfer %s: release not delivered (%s); the prefill server's timeout frees it", transfer_id, e
            )

    threading.Thread(target=send, name="rlserve-kv-release", daemon=True).start()
