"""Keep freed host memory in the process instead of handing it back to the kernel.

A CPU step allocates the same multi-megabyte buffers every time. glibc serves blocks that large
with fresh mmaps, or trims them off the heap top when freed, so each step page-faults its working
set in again. With unpacked weights (`engine.pack_weights` off, or not fp32) MKL's sgemm packs
every weight into such a buffer on each call: ~3,000 faults per decode step for the SmolLM2-135M
shape at 32 sequences. Raising the mmap and trim thresholds keeps the pages mapped and reused;
the price is that the heap stays at its peak size."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_MAX = 32 << 20  # glibc refuses larger values on 64-bit
TRIM_THRESHOLD = 1 << 30
TOP_PAD = 64 << 20

_done = False


def keep_freed_memory() -> bool:
    """Tune glibc malloc once per process; False where there is no glibc (macOS, musl, Windows)."""
    global _done
    if _done:
        return True
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    ok = all(
        mallopt(param, value) == 1
        for param, value in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD),
            (M_TOP_PAD, TOP_PAD),
        )
    )
    if not ok:
        log.debug("mallopt refused a setting; freed memory may be returned to the kernel")
    _done = ok
    return ok


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (free plus reclaimable); None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None
