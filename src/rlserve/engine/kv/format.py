"""One KV block as bytes, for the disk tier and P/D transfer (engine/kv/transfer.py): never pickled.

    MAGIC (8) | header length (u32 LE) | header (JSON) | payload | xxh3-128 of everything before (16)

The checksum catches truncation and corruption (a torn disk write, a bad copy); it is not a signature:
the disk tier lives in a private directory and transfers stay on a private network. xxh3 runs at memory
speed, where sha256 (~1 GB/s) capped a P/D pull well below a raw socket's rate.

The header names the block (its chained prefix-cache hash and weight generation) and describes
every tensor in the payload: the KV itself, `[layers, 2 (k, v), block_size, kv_heads, head_dim]`,
then optional per-block metadata arrays (e.g. the routed experts of each token, for router replay).
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
import xxhash

MAGIC = b"RLKVBLK2"
FORMAT_VERSION = 2
KV_LAYOUT = ["layers", "kv", "block_size", "kv_heads", "head_dim"]
CHECKSUM_BYTES = 16
PREFIX_BYTES = len(MAGIC) + 4  # magic and header length: what a reader needs before the header
checksum = xxhash.xxh3_128
_MAX_HEADER_BYTES = 1 << 20
_MIN_RUN_BYTES = 4096  # shorter contiguous runs are gathered into one copy instead
DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "bfloat16", "float16", "int64", "int32", "int16", "int8", "uint8")
}


class BlockFormatError(ValueError):
    """The bytes are not a valid block, or not the block that was asked for."""


@dataclass(slots=True)
class KVBlock:
    block_hash: bytes
    kv: torch.Tensor  # [layers, 2, block_size, kv_heads, head_dim]
    weight_generation: int = 0
    # per-block arrays with a leading block_size dimension (routed experts, ...); a reader that
    # needs one the block lacks must recompute the block
    metadata: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def block_size(self) -> int:
        return self.kv.shape[2]


def tensor_views(t: torch.Tensor) -> list[memoryview]:
    """The tensor's bytes in row-major order, as views of its own memory where it lies in contiguous runs
    (a block sliced out of the pool: one run per layer and k/v), so encoding copies nothing and receiving
    into them writes the pool itself. Elsewhere a view of one contiguous copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    lead = 0  # leading dims to iterate over; the rest of each slice is contiguous
    while lead < t.dim() and not t[(0,) * lead].is_contiguous():
        lead += 1
    if t.numel() == 0 or lead == 0 or lead > 2 or lead == t.dim() or t[(0,) * lead].nbytes < _MIN_RUN_BYTES:
        return [memoryview(t.contiguous().view(torch.uint8).reshape(-1).numpy())]  # one copy
    # slices of one view of the whole storage: a torch view per run costs more than hashing it
    whole = memoryview(torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy())
    item, run, offset, stride = t.element_size(), t[(0,) * lead].nbytes, t.storage_offset(), t.stride()
    inner = range(t.shape[1]) if lead == 2 else range(1)
    starts = [(offset + i * stride[0] + j * stride[1]) * item for i in range(t.shape[0]) for j in inner]
    return [whole[s : s + run] for s in starts]


def _dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise BlockFormatError(f"dtype {name} cannot be stored in a KV block")
    return name


def _tensor_entry(name: str, shape, dtype: torch.dtype, offset: int, nbytes: int) -> dict:
    return {"name": name, "dtype": _dtype_name(dtype), "shape": list(shape), "offset": offset, "nbytes": nbytes}


def _head(block_hash: bytes, weight_generation: int, block_size: int, tensors: list[dict]) -> memoryview:
    """MAGIC, header length and header, padded so that the KV starts 64-byte aligned."""
    header = json.dumps(
        {
            "format": FORMAT_VERSION,
            "hash": block_hash.hex(),
            "weight_generation": weight_generation,
            "block_size": block_size,
            "layout": KV_LAYOUT,
            "tensors": tensors,
        },
        separators=(",", ":"),
    ).encode()
    header += b" " * (-(PREFIX_BYTES + len(header)) % 64)
    return memoryview(MAGIC + struct.pack("<I", len(header)) + header)


def _parts(block: KVBlock) -> list[memoryview]:
    if block.kv.dim() != 5 or block.kv.shape[1] != 2:
        raise BlockFormatError(f"kv must be [layers, 2, block_size, kv_heads, head_dim], got {list(block.kv.shape)}")
    tensors, offset, payload = [], 0, []
    for name, t in [("kv", block.kv), *sorted(block.metadata.items())]:
        raw = tensor_views(t)
        nbytes = sum(r.nbytes for r in raw)
        tensors.append(_tensor_entry(name, t.shape, t.dtype, offset, nbytes))
        payload += raw
        offset += nbytes
    return [_head(block.block_hash, block.weight_generation, block.block_size, tensors), *payload]


# a per-block array beside the KV: (name, shape with block_size first, dtype)
MetadataSpec = tuple[str, tuple[int, ...], torch.dtype]


def _layout(shape: tuple[int, ...], dtype: torch.dtype, metadata: tuple[MetadataSpec, ...]) -> list[dict]:
    """The tensor entries of a block holding KV of this shape and dtype, then `metadata` in name order: _parts'."""
    entries, offset = [], 0
    for name, s, dt in [("kv", shape, dtype), *sorted(metadata, key=lambda m: m[0])]:
        nbytes = math.prod(s) * torch.empty(0, dtype=dt).element_size()
        entries.append(_tensor_entry(name, s, dt, offset, nbytes))
        offset += nbytes
    return entries


def kv_head(
    block_hash: bytes,
    weight_generation: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    metadata: tuple[MetadataSpec, ...] = (),
) -> bytes:
    """MAGIC, header length and header of a block holding KV (and `metadata`): what precedes its payload."""
    return bytes(_head(block_hash, weight_generation, shape[2], _layout(shape, dtype, metadata)))


def kv_heads(
    block_hashes: list[bytes],
    weight_generation: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    metadata: tuple[MetadataSpec, ...] = (),
) -> list[bytes]:
    """kv_head of each block: one header made, the others by putting each hash in its place (equal-length
    hashes give equal-length headers)."""
    if not block_hashes:
        return []
    template = kv_head(block_hashes[0], weight_generation, shape, dtype, metadata)
    at = template.index(block_hashes[0].hex().encode())
    end = at + 2 * len(block_hashes[0])
    return [
        template[:at] + h.hex().encode() + template[end:]
        if len(h) == len(block_hashes[0])
        else kv_head(h, weight_generation, shape, dtype, metadata)
        for h in block_hashes
    ]


def kv_parts(
    block_hash: bytes,
    weight_generation: int,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    views: list[memoryview],
    head: bytes | None = None,
    digest: bytes | None = None,
    metadata: tuple[MetadataSpec, ...] = (),
) -> list[memoryview | bytes]:
    """`encode_parts` of a block holding KV (and `metadata`), given as the views of its bytes in order
    (PoolBlocks, then each array's in name order). `head` and `digest`: what an earlier call gave for the
    same block (its first and last part), when its bytes have not changed since."""
    head = head if head is not None else kv_head(block_hash, weight_generation, shape, dtype, metadata)
    if digest is None:
        h = checksum(head)
        for v in views:
            h.update(v)
        digest = h.digest()
    return [head, *views, digest]


class PoolBlocks:
    """A CPU KV pool's blocks ([layers, 2, blocks * block_size, kv_heads, head_dim], contiguous) as views of
    their per-layer k/v runs, the bytes tensor_views gives for a block's slice, from offsets alone: no torch
    op per block. Sending reads the pool through them; receiving writes it."""

    def __init__(self, kv_cache: torch.Tensor, block_size: int):
        if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
            raise ValueError("PoolBlocks needs a contiguous CPU pool")
        self.whole = memoryview(kv_cache.view(-1).view(torch.uint8).numpy())
        item, stride = kv_cache.element_size(), kv_cache.stride()
        self.run = block_size * stride[2] * item  # one layer's k (or v) for one block
        self.starts = [(i * stride[0] + j * stride[1]) * item for i in range(kv_cache.shape[0]) for j in range(2)]

    def views(self, block: int) -> list[memoryview]:
        base, run, whole = block * self.run, self.run, self.whole
        return [whole[base + s : base + s + run] for s in self.starts]


def encode_parts(block: KVBlock) -> list[memoryview | bytes]:
    """`encode` without joining: the pieces to write one after the other (a socket's sendmsg)."""
    parts = _parts(block)
    h = checksum()
    for p in parts:
        h.update(p)
    return [*parts, h.digest()]


def encode(block: KVBlock) -> bytes:
    return b"".join(encode_parts(block))


def write_file(path: str | Path, block: KVBlock) -> int:
    """Write atomically (temporary file, then rename); returns the file's size."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    parts, h, size = _parts(block), checksum(), 0
    try:
        with open(tmp, "wb") as f:
            for p in parts:
                f.write(p)
                h.update(p)
                size += p.nbytes
            f.write(h.digest())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return size + CHECKSUM_BYTES


def read_file(path: str | Path, **expect) -> KVBlock:
    """`decode` of a file's bytes; OSError if it cannot be read."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        if f.readinto(data) != size:
            raise BlockFormatError(f"{path}: short read")
    return decode(data, **expect)


def decode(
    data: bytes | bytearray,
    *,
    expect_hash: bytes | None = None,
    expect_shape: tuple[int, ...] | None = None,
    expect_dtype: torch.dtype | None = None,
) -> KVBlock:
    """Check the checksum, the header and that the block is the one expected; tensors share `data`."""
    data = data if isinstance(data, bytearray) else bytearray(data)
    fixed = PREFIX_BYTES
    if len(data) < fixed + CHECKSUM_BYTES or data[: len(MAGIC)] != MAGIC:
        raise BlockFormatError("not a KV block (bad magic or too short)")
    body = memoryview(data)[: len(data) - CHECKSUM_BYTES]
    if checksum(body).digest() != bytes(data[len(data) - CHECKSUM_BYTES :]):
        raise BlockFormatError("checksum mismatch: the block is truncated or corrupted")
    header_len = header_length(data[:fixed])
    if header_len > len(body) - fixed:
        raise BlockFormatError(f"header length {header_len} exceeds the block")
    header, tensors, block_hash, generation = _parse_header(body[fixed : fixed + header_len])
    payload = body[fixed + header_len :]
    out = {name: _tensor(payload, t) for name, t in tensors.items()}
    if sum(t["nbytes"] for t in tensors.values()) != len(payload):
        raise BlockFormatError("payload size does not match the header")
    kv = out.pop("kv")
    if kv.dim() != 5 or kv.shape[1] != 2 or kv.shape[2] != header.get("block_size"):
        raise BlockFormatError(f"kv shape {list(kv.shape)} does not match layout {KV_LAYOUT}")
    if expect_hash is not None and block_hash != expect_hash:
        raise BlockFormatError("the block holds a different hash than the one asked for")
    if expect_shape is not None and tuple(kv.shape) != tuple(expect_shape):
        raise BlockFormatError(f"kv shape {list(kv.shape)}, expected {list(expect_shape)}")
    if expect_dtype is not None and kv.dtype != expect_dtype:
        raise BlockFormatError(f"kv dtype {kv.dtype}, expected {expect_dtype}")
    return KVBlock(block_hash, kv, generation, out)


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """The header's length, from a block's first PREFIX_BYTES."""
    if len(prefix) < PREFIX_BYTES or prefix[: len(MAGIC)] != MAGIC:
        raise BlockFormatError("not a KV block (bad magic or too short)")
    (n,) = struct.unpack_from("<I", prefix, len(MAGIC))
    if n > _MAX_HEADER_BYTES:
        raise BlockFormatError(f"header length {n} is larger than {_MAX_HEADER_BYTES}")
    return n


def _parse_header(raw: bytes | bytearray | memoryview) -> tuple[dict, dict[str, dict], bytes, int]:
    try:
        header = json.loads(bytes(raw))
        tensors = {t["name"]: t for t in header["tensors"]}
        block_hash = bytes.fromhex(header["hash"])
        generation = int(header["weight_generation"])
    except (ValueError, KeyError, TypeError) as e:
        raise BlockFormatError(f"bad header: {e}") from None
    if header.get("format") != FORMAT_VERSION or header.get("layout") != KV_LAYOUT or "kv" not in tensors:
        raise BlockFormatError(f"unsupported block format {header.get('format')!r} / layout {header.get('layout')!r}")
    return header, tensors, block_hash, generation


def layout_header(
    raw: bytes | bytearray | memoryview,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    metadata: tuple[MetadataSpec, ...] = (),
) -> tuple[bytes, int]:
    """The hash and weight generation of a block whose payload is its KV of this shape and dtype at offset 0,
    then exactly `metadata` (kv_head's layout): a reader that streams the payload straight into place (P/D
    pulls) checks this before it."""
    header, tensors, block_hash, generation = _parse_header(raw)
    expected = _layout(shape, dtype, metadata)
    if sorted(tensors) != sorted(e["name"] for e in expected):
        raise BlockFormatError(
            f"the block carries {sorted(tensors)}, this reader places {sorted(e['name'] for e in expected)}"
        )
    for want in expected:
        got = tensors[want["name"]]
        if any(got.get(k) != want[k] for k in ("dtype", "shape", "offset", "nbytes")):
            raise BlockFormatError(
                f"{want['name']} {got.get('dtype')} {got.get('shape')} at offset {got.get('offset')}, expected "
                f"{want['dtype']} {want['shape']} at offset {want['offset']}"
            )
    if header.get("block_size") != shape[2]:
        raise BlockFormatError(f"block_size {header.get('block_size')}, expected {shape[2]}")
    return block_hash, generation


def _tensor(payload: memoryview, spec: dict) -> torch.Tensor:
    try:
        dtype = DTYPES[spec["dtype"]]
        shape = [int(d) for d in spec["shape"]]
        offset, nbytes = int(spec["offset"]), int(spec["nbytes"])
    except (KeyError, TypeError, ValueError) as e:
        raise BlockFormatError(f"bad tensor entry {spec!r}: {e}") from None
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if (
        min(shape, default=0) < 0
        or math.prod(shape) * itemsize != nbytes
        or offset < 0
        or offset + nbytes > len(payload)
    ):
        raise BlockFormatError(f"tensor {spec.get('name')!r} does not fit its shape or the payload")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    raw = torch.frombuffer(payload, dtype=torch.uint8, count=nbytes, offset=offset)
    return raw.view(dtype).view(shape)
