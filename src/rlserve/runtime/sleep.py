"""vLLM's sleep mode in the engine process: /sleep frees the KV cache's memory (the pool's one tensor
gets empty storage, so the allocator returns its pages to the OS) and /wake_up allocates it again.
Sleeping pauses the engine; requests in flight are aborted first, since their cache goes.

Level 1 and 2 both free the KV cache. The weights stay resident at level 2 (see docs/vllm-compat.md):
freeing them would mean reloading the served checkpoint on wake, losing a trainer's pushed weights.
Registered into runtime/core.py's OPS.
"""

from __future__ import annotations

from typing import Any

import torch

TAGS = ("weights", "kv_cache")


def _asleep(core: Any) -> set[str]:
    if not hasattr(core, "asleep"):
        core.asleep = set()
    return core.asleep


def _check_supported(core: Any) -> None:
    e = core.engine
    if e.tp is not None or e.kv_transfer is not None or getattr(e, "offload", None) is not None:
        raise ValueError(
            "sleep frees the KV cache, which tensor parallelism, KV transfer and KV offload keep "
            "views of: it is refused with those on"
        )


def _free_kv(core: Any) -> None:
    kv = core.engine.runner.kv_cache
    if "kv_cache" in _asleep(core) or kv.numel() == 0:
        return
    core.kv_shape = tuple(kv.shape)
    core.engine.pool.reset_prefix_cache()  # the cached blocks' contents go with the memory
    kv.set_(torch.empty(0, dtype=kv.dtype, device=kv.device))
    _asleep(core).add("kv_cache")


def op_sleep(core: Any, call_id: int, level: int, mode: str) -> int:
    """Pause (aborting what runs), then free what the level names; returns how many requests were aborted."""
    if mode != "abort":
        raise ValueError("sleep frees the KV cache that in-flight requests use: only mode=abort is accepted")
    _check_supported(core)
    aborted = core.engine.abort_all()
    core.pause.paused = True
    _asleep(core).add("paused")
    if level >= 1:
        _free_kv(core)
    return aborted


def op_release_kv_cache(core: Any, call_id: int) -> int:
    return op_sleep(core, call_id, 1, "abort")


def op_wake_up(core: Any, call_id: int, tags: list[str] | None) -> bool:
    """Allocate again what the tags name (all when None); True once fully awake, and the engine resumes."""
    asleep = _asleep(core)
    wanted = set(TAGS if tags is None else tags)
    if "kv_cache" in wanted and "kv_cache" in asleep:
        kv = core.engine.runner.kv_cache
        kv.set_(torch.zeros(core.kv_shape, dtype=kv.dtype, device=kv.device))
        asleep.discard("kv_cache")
    if asleep <= {"paused"}:
        if "paused" in asleep:
            core.pause.resume(core.engine)
        asleep.clear()
        return True
    return False


def op_is_sleeping(core: Any, call_id: int) -> bool:
    return bool(_asleep(core))


OPS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("op_")}
