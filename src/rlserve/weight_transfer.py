"""Moving named tensors from a trainer to servers over torch.distributed, without pickling.

One push is: an int64 bucket count, then per bucket an int64 header length, a uint8 JSON header
[[name, dtype, shape, offset, nbytes], ...] and one flat uint8 buffer holding the tensors' bytes.
Buckets of ~256 MiB move a 135M-parameter fp32 model in three collectives. Trainer = rank 0.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_BUCKET_BYTES = 256 << 20
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def init_group(host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0, backend: str | None = None):
    """gloo on CPU, NCCL when CUDA is available; the process's default group."""
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def _buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    bucket, size = [], 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        yield bucket


def send(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES, device: str = "cpu") -> int:
    """Broadcast from rank 0; returns the number of bytes sent."""
    buckets = list(_buckets(named, bucket_bytes))
    dist.broadcast(torch.tensor([len(buckets)], dtype=torch.int64, device=device), src=0)
    total = 0
    for bucket in buckets:
        header, offset = [], 0
        for name, t in bucket:
            dtype = str(t.dtype).removeprefix("torch.")
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: dtype {t.dtype} cannot be pushed; use a floating-point dtype")
            nbytes = t.numel() * t.element_size()
            header.append([name, dtype, list(t.shape), offset, nbytes])
            offset += nbytes
        raw = torch.frombuffer(bytearray(json.dumps(header).encode()), dtype=torch.uint8).to(device)
        dist.broadcast(torch.tensor([raw.numel()], dtype=torch.int64, device=device), src=0)
        dist.broadcast(raw, src=0)
        flat = torch.empty(offset, dtype=torch.uint8, device=device)
        for (_, t), (_, _, _, start, nbytes) in zip(bucket, header):
            flat[start : start + nbytes].copy_(t.detach().contiguous().view(-1).view(torch.uint8))
        dist.broadcast(flat, src=0)
        total += offset
    return total


def receive(device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Receive one push on a non-zero rank, yielding tensors as each bucket arrives."""
    count = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(count, src=0)
    for _ in range(int(count.item())):
        length = torch.zeros(1, dtype=torch.int64, device=device)
        dist.broadcast(length, src=0)
        raw = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        dist.broadcast(raw, src=0)
        header = json.loads(raw.cpu().numpy().tobytes().decode())
        total = sum(entry[4] for entry in header)
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        dist.broadcast(flat, src=0)
        for name, dtype, shape, start, nbytes in header:
            if dtype not in _DTYPES:
                raise ValueError(f"{name}: unsupported dtype {dtype!r}")
            yield name, flat[start : start + nbytes].view(_DTYPES[dtype]).view(shape)
