"""vLLM's sleep mode in the engine process: /sleep frees the KV cache's memory (the pool's one tensor
gets empty storage, so the allocator returns its pages to the OS) and /wake_up allocates it again.
Sleeping pauses the engine; requests in flight are aborted first, since their cache goes.

Level 1 frees the KV cache and keeps the weights (vLLM moves them to host memory, where a CPU engine
already holds them). Level 2 also releases the weights' memory (model/release.py), as vLLM discards
them: after /wake_up their contents are undefined, and requests are refused (503) until a weight
update or /collective_rpc reload_weights has written every tensor (docs/vllm-compat.md).
Registered into runtime/core.py's OPS.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Any

import torch

from rlserve.engine.weights import StagingBuffers
from rlserve.model.release import allocate_weights, release_weights, weights_unready

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


def _check_weights_releasable(core: Any) -> None:
    e = core.engine
    if e.device.type != "cpu" or e.model.expert_parallel or core.dp_sync is not None:
        raise ValueError(
            "sleep level 2 releases the weights' host memory on a CPU engine without expert parallelism; "
            "use level 1 (frees the KV cache) here"
        )


def _free_weights(core: Any) -> None:
    if "weights" in _asleep(core):
        return
    release_weights(core.engine.model)
    core.staging = StagingBuffers()  # the last update's file bytes: a model's worth, reused by the next update
    _asleep(core).add("weights")


@functools.cache
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None: freed tensors under its mmap threshold stay in the heap without it."""
    libc = ctypes.util.find_library("c")
    fn = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if fn is not None:
        fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def _return_to_os() -> None:
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def refusal(core: Any) -> str | None:
    """Why a new request is refused now (the weights released or not restored yet), or None."""
    return weights_unready(core.engine.model)


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
    if level >= 2:
        _check_weights_releasable(core)
    aborted = core.engine.abort_all()
    core.pause.paused = True
    _asleep(core).add("paused")
    if level >= 1:
        _free_kv(core)
    if level >= 2:
        _free_weights(core)
    _return_to_os()
    return aborted


def op_release_kv_cache(core: Any, call_id: int) -> int:
    return op_sleep(core, call_id, 1, "abort")


def op_wake_up(core: Any, call_id: int, tags: list[str] | None) -> bool:
    """Allocate again what the tags name (all when None); True once fully awake, and the engine resumes."""
    asleep = _asleep(core)
    wanted = set(TAGS if tags is None else tags)
    if "weights" in wanted and "weights" in asleep:
        allocate_weights(core.engine.model)
        asleep.discard("weights")
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
