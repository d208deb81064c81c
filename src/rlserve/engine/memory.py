"""How much memory the KV cache may take: a byte budget, a fraction of memory (gpu_memory_utilization), or the default cap."""

from __future__ import annotations

import os

import torch

DEFAULT_KV_CAP = 1 << 30  # bytes, when neither engine.kv_cache_bytes nor memory_budget_bytes is set


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


def num_kv_blocks(budget: int | None, per_token: int, block_size: int, max_num_seqs: int, max_model_len: int) -> int:
    """Blocks that fit `budget` bytes; without one, enough for every sequence at full length up to DEFAULT_KV_CAP."""
    per_block = per_token * block_size
    if budget is None:
        wanted = max_num_seqs * max_model_len * per_block // block_size
        budget = min(wanted, DEFAULT_KV_CAP)
    return max(1, budget // per_block)
