"""How much memory the KV cache may take when the user gives a fraction (gpu_memory_utilization)."""

from __future__ import annotations

import os

import torch


def memory_at_start(device: torch.device) -> int:
    """Bytes the fraction applies to: the device's total memory on CUDA, the memory available now on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[1]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def kv_budget(fraction: float, memory: int, weight_bytes: int, useful_bytes: int) -> int:
    """KV bytes under `fraction` of `memory` once the weights are in, never more than can be used."""
    budget = int(fraction * memory) - weight_bytes
    if budget <= 0:
        raise ValueError(
            f"gpu_memory_utilization={fraction} allows {fraction * memory / 2**30:.2f} GiB, which the weights "
            f"({weight_bytes / 2**30:.2f} GiB) already fill: raise gpu_memory_utilization or set engine.kv_cache_bytes"
        )
    return min(budget, useful_bytes)
