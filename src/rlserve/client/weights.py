"""The trainer's half of a weight push: one torch.distributed group with every server, rank 0 here."""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import httpx
import torch
import torch.distributed as dist

from rlserve import weight_transfer


class WeightBroadcaster:
    """Push named tensors into running servers without touching disk.

    connect() asks every server (or deployment admin address: all its replicas) to join a group (gloo
    on CPU, NCCL on CUDA) and joins it as rank 0;
    push() broadcasts the tensors in large buckets while each server's /update_weights call is
    open, and returns the servers' new policy versions (bumped once per push).
    """

    def __init__(
        self,
        server_urls: list[str],
        host: str = "127.0.0.1",
        port: int = 29555,
        *,
        admin_api_key: str | None = None,
        timeout_s: float = 300.0,
        bucket_bytes: int = weight_transfer.DEFAULT_BUCKET_BYTES,
    ):
        self.server_urls = [u.rstrip("/") for u in server_urls]
        self.host, self.port, self.timeout_s, self.bucket_bytes = host, port, timeout_s, bucket_bytes
        headers = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else {}
        self._http = httpx.Client(headers=headers, timeout=timeout_s)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(server_urls)))

    def connect(self) -> None:
        # a deployment's admin address stands for all its replicas: it says how many ranks it takes
        sizes = [self._http.get(f"{url}/get_world_size").json()["world_size"] for url in self.server_urls]
        n, offset = sum(sizes), 0
        for url, size in zip(self.server_urls, sizes):
            body = {
                "host": self.host,
                "port": self.port,
                "rank_offset": offset,
                "inference_world_size": n,
                "timeout": self.timeout_s,
            }
            self._http.post(f"{url}/init_broadcaster", json=body).raise_for_status()
            offset += size
        weight_transfer.init_group(self.host, self.port, 0, n + 1, self.timeout_s)

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], weight_version: str | None = None) -> list[int]:
        body = {"weight_dir": None, "weight_version": weight_version}
        calls = [self._pool.submit(self._http.post, f"{url}/update_weights", json=body) for url in self.server_urls]
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        weight_transfer.send(((n, t.to(device)) for n, t in named_tensors), self.bucket_bytes, device)
        versions = []
        for call in calls:
            response = call.result()
            response.raise_for_status()
            versions.append(response.json()["policy_version"])
        return versions

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self._http.close()
        self._pool.shutdown()

    def __enter__(self) -> WeightBroadcaster:
        self.connect()
        return self

    def __exit__(self, *exc) -> None:
        self.close()
