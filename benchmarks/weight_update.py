"""Weight-update cost against its floor, in one run, on a random SmolLM2-135M-shaped fp32 model.

1. disk: rlserve's update from a safetensors directory (read, validate every tensor, swap) vs
   merely reading the same files with safetensors.
2. push: WeightBroadcaster.push into a running `rlserve serve` over gloo (the server receives,
   validates, swaps, bumps the version) vs a raw torch.distributed broadcast of the same bytes
   between two processes.

    python benchmarks/weight_update.py [--preset smollm2-135m] [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _server import rlserve_server
from rlserve import weight_transfer
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.weights import StagingBuffers, stage_from_dir
from rlserve.model.loader import read_safetensors, safetensors_files
from rlserve.model.make import bench_cache_dir, make_model
from rlserve.runtime.ports import free_port


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_disk(base: Path, update: Path, repeats: int) -> tuple[float, float, int]:
    cfg = Config()
    cfg.model.name = str(base)
    cfg.model.max_model_len = 256
    cfg.engine.kv_cache_bytes = 64 << 20
    engine = Engine(cfg)
    files = safetensors_files(update)
    nbytes = sum(f.stat().st_size for f in files)

    def read_only():
        for f in files:  # every byte into memory: the least any loader must do
            f.read_bytes()

    staging = StagingBuffers()  # as the server keeps one for its updates

    def rlserve_update():
        engine.commit_weights(stage_from_dir(engine.model, update, staging))

    read_only()  # warm the page cache for both
    return median_time(read_only, repeats), median_time(rlserve_update, repeats), nbytes


def _raw_receiver(port: int, sizes: list[int]) -> None:
    weight_transfer.init_group("127.0.0.1", port, 1, 2)
    dist.barrier()
    for size in sizes:
        buf = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(buf, src=0)
    dist.destroy_process_group()


def bench_raw_broadcast(tensors: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> float:
    """A bare broadcast of the same bytes in the same bucket sizes, between two processes."""
    sizes = [
        sum(t.numel() * t.element_size() for _, t in b) for b in weight_transfer._buckets(tensors.items(), bucket_bytes)
    ]
    times = []
    for _ in range(repeats):
        port = free_port()
        ctx = mp.get_context("spawn")
        peer = ctx.Process(target=_raw_receiver, args=(port, sizes))
        peer.start()
        weight_transfer.init_group("127.0.0.1", port, 0, 2)
        bufs = [torch.empty(s, dtype=torch.uint8) for s in sizes]
        dist.barrier()
        start = time.perf_counter()
        for buf in bufs:
            dist.broadcast(buf, src=0)
        times.append(time.perf_counter() - start)
        dist.destroy_process_group()
        peer.join()
    return statistics.median(times)


def bench_push(base: Path, tensors: dict[str, torch.Tensor], bucket_bytes: int, repeats: int) -> float:
    from rlserve.client.weights import WeightBroadcaster

    times = []
    with rlserve_server(
        "--model.name", str(base), "--model.max_model_len", "256", "--engine.kv_cache_bytes", str(64 << 20)
    ) as server:
        with WeightBroadcaster([server.url], "127.0.0.1", free_port(), bucket_bytes=bucket_bytes) as b:
            for _ in range(repeats):
                start = time.perf_counter()
                b.push(tensors.items())
                times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bucket-mib", type=int, default=256)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    base = make_model(args.preset, bench_cache_dir() / f"{args.preset}-seed0")
    update = make_model(args.preset, bench_cache_dir() / f"{args.preset}-seed1", seed=1)
    bucket = args.bucket_mib << 20

    read_s, update_s, nbytes = bench_disk(base, update, args.repeats)
    tensors = dict(read_safetensors(safetensors_files(update)))
    raw_s = bench_raw_broadcast(tensors, bucket, args.repeats)
    push_s = bench_push(base, tensors, bucket, args.repeats)

    mb = nbytes / 1e6
    rows = [
        ("read safetensors only (floor)", read_s, None),
        ("rlserve update from disk", update_s, update_s / read_s),
        ("raw torch.distributed broadcast (floor)", raw_s, None),
        ("rlserve WeightBroadcaster.push", push_s, push_s / raw_s),
    ]
    print(
        f"\nweight update, {args.preset}, {mb:.0f} MB fp32, median of {args.repeats}, {torch.get_num_threads()} threads"
    )
    print(f"{'path':42s} {'seconds':>8s} {'GB/s':>7s} {'vs floor':>9s}")
    for name, secs, ratio in rows:
        print(f"{name:42s} {secs:8.3f} {nbytes / secs / 1e9:7.2f} {'' if ratio is None else f'{ratio:8.2f}x':>9s}")
    print("target: <= 1.5x each floor")
    print(json.dumps({"read_s": read_s, "update_s": update_s, "raw_broadcast_s": raw_s, "push_s": push_s}))


if __name__ == "__main__":
    main()
