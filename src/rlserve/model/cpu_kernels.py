"""CPU kernels in C, built with the machine's C compiler at first use and loaded through ctypes.

Only what PyTorch has no fast op for: decode attention that reads K/V where they lie in the
paged cache (`kernels/paged_attention.c`). The eager alternative gathers every sequence's blocks
into a contiguous copy for SDPA, reading the cache, writing it and reading it again.

The shared library is cached under `$RLSERVE_CACHE_DIR/kernels` (default ~/.cache/rlserve), keyed by
the source, the compiler and the machine; `-march=native` code never moves to another CPU kind.
Where there is no compiler, or the build or its self-check fails, callers get None and keep the
eager path (logged once).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from rlserve.model.make import cache_root

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels") / "paged_attention.c"
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-fPIC", "-shared"]


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(cc: str) -> Path:
    source = SOURCE.read_bytes()
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(source + version.encode() + " ".join(FLAGS).encode() + _cpu_id().encode()).hexdigest()[:16]
    lib = _cache_dir() / f"paged_attention-{key}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes starting together never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], check=True, capture_output=True, text=True, timeout=120)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _cpu_id() -> str:
    """The CPU model and flags: -march=native code is only valid where they are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


class PagedAttention:
    """The compiled kernel; `__call__` has the signature of `reference_paged_attention`."""

    def __init__(self, lib: ctypes.CDLL):
        self._fn = lib.rlserve_paged_attention
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        self._fn.argtypes = [ptr] * 6 + [i64] * 6 + [ctypes.c_float, ctypes.c_int]
        self._fn.restype = None
        self._limits = lib.rlserve_paged_attention_limits
        self._limits.argtypes = [i64] * 3
        self._limits.restype = ctypes.c_int

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and bool(self._limits(num_heads // num_kv_heads, head_dim, block_size))

    def __call__(self, q, k_cache, v_cache, blocks, ctx_lens, block_size: int, scale: float) -> torch.Tensor:
        b, h, d = q.shape
        q = q.contiguous()  # the caller's q is a view into the fused QKV rows
        assert k_cache.is_contiguous() and v_cache.is_contiguous() and blocks.is_contiguous()
        assert blocks.dtype == torch.int64 and ctx_lens.dtype == torch.int64 and ctx_lens.is_contiguous()
        out = torch.empty_like(q)
        self._fn(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), ctx_lens.data_ptr(), out.data_ptr(),
            b, blocks.shape[1], h, k_cache.shape[1], d, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out


def reference_paged_attention(q, k_cache, v_cache, blocks, ctx_lens, block_size: int, scale: float) -> torch.Tensor:
    """What the kernel computes, in torch: q [B, H, D], caches [slots, KVH, D], blocks [B, W],
    ctx_lens [B] -> [B, H, D]."""
    b, w = blocks.shape
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    slots = (blocks.unsqueeze(2) * block_size + torch.arange(block_size)).view(b, w * block_size)
    mask = (torch.arange(w * block_size) < ctx_lens.unsqueeze(1)).view(b, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q.view(b, nkv, -1, d), k_cache[slots].transpose(1, 2), v_cache[slots].transpose(1, 2), attn_mask=mask, scale=scale
    )
    return out.reshape(q.shape)


@functools.cache
def paged_attention() -> PagedAttention | None:
    """The kernel, built and self-checked once per process; None where it cannot be had."""
    if platform.system() != "Linux" or os.environ.get("RLSERVE_NO_CPU_KERNELS"):
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC); decode attention uses gather + SDPA")
        return None
    try:
        kernel = PagedAttention(ctypes.CDLL(str(_build(cc))))
        _self_check(kernel)
    except (OSError, subprocess.SubprocessError, AssertionError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU paged-attention kernel is unavailable (%s); decode attention uses gather + SDPA", detail)
        return None
    return kernel


def _self_check(kernel: PagedAttention) -> None:
    """Against gather + SDPA, through the generic and a special-cased head size."""
    gen = torch.Generator().manual_seed(0)
    bs, nkv, group = 4, 2, 3
    blocks = torch.tensor([[3, 7, 1], [5, 0, 0], [11, 2, 9]])
    ctx_lens = torch.tensor([10, 1, 12])
    for d in (16, 64):
        k_cache, v_cache = torch.randn(2, 12 * bs, nkv, d, generator=gen).unbind(0)
        q = torch.randn(3, nkv * group, d, generator=gen)
        got = kernel(q, k_cache.contiguous(), v_cache.contiguous(), blocks, ctx_lens, bs, 0.25)
        want = reference_paged_attention(q, k_cache, v_cache, blocks, ctx_lens, bs, 0.25)
        assert torch.allclose(got, want, atol=1e-5), f"self-check differs by {(got - want).abs().max().item():.2e}"
