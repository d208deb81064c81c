"""CPU kernels in C, built with the machine's C compiler at first use and loaded through ctypes.

Only what PyTorch has no fast op for on CPU, in `kernels/`, each in an fp32 and a bf16 instance
(bf16 storage, fp32 arithmetic; `scalar.h`):
- `paged_attention.c`: attention of decode rows, and of a prompt's rows as tiles of consecutive
  positions, reading K/V where they lie in the paged cache. The eager path gathers every
  sequence's blocks into a contiguous copy for SDPA, reading the cache, writing it and reading it
  again; a tile shares each K/V read among its rows, at 2.5-3x the old kernel's one row per read.
- `fused_ops.c`: the element-wise steps between a layer's matmuls (residual add + RMSNorm,
  q/k norm + RoPE + KV-cache write, SiLU x up), one call each instead of 3-8 eager ops.
- `gemv.c`: the projections. `gemm_impl.h`, an outer-product GEMM over weights packed into panels
  (`PanelWeight`), each output summed in K order in its own lane: every row count on AVX-512 and in
  batch-invariant mode; elsewhere `gemv_impl.h` for a few rows (decode at small batch), reading
  each weight once in its own layout, where MKL's and oneDNN's GEMMs read it slower.
- `sample.c`: the sampler's common case (temperature 1 or greedy, nothing else), one walk per row.
- `parallel.c`: the one thread pool all of them share (no OpenMP: see there why).

The shared library is cached under `$RLSERVE_CACHE_DIR/kernels` (default ~/.cache/rlserve),
keyed by the sources, the compiler and the CPU; `-march=native` code never moves to another CPU
kind. Where there is no compiler, or the build or its self-check fails, `cpu_kernels()` is None
and the model keeps its PyTorch path (logged once).
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

KERNEL_DIR = Path(__file__).with_name("kernels")
SOURCES = sorted(KERNEL_DIR.glob("*.c"))
DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Up to these rows a projection goes through `gemv` rather than MKL's/oneDNN's packed GEMM: measured
# on 2 cores (AVX-512, AVX512_BF16) with every SmolLM2-135M projection and its LM head, 1.0-1.2x at 1
# row and 2-10x at 4-8 rows (fp32), 1.3-1.7x up to 16 rows (bf16).
GEMV_MAX_ROWS = {torch.float32: 8, torch.bfloat16: 16}
# Threads the GEMV splits its outputs over; 0: torch's thread count. Not an OpenMP team: parallel.c's
# caller + helpers never wait for a descheduled thread at a barrier (OpenMP's two threads were 2-4x
# slower than one on the shared box; caller + helper ~1.6x faster than one at 1-4 rows).
GEMV_THREADS = int(os.environ.get("RLSERVE_GEMV_THREADS", "0"))
FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fPIC", "-shared"]


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _cpu_id() -> str:
    """The CPU model and flags: -march=native code is only valid where they are the same."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() + platform.machine()


NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX512_BF16 / AMX; aarch64 BF16


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether the CPU multiplies bf16 natively (from /proc/cpuinfo's flags); without it bf16
    GEMMs are emulated and several times slower than fp32."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    flags = {f for ln in lines if ln.startswith(("flags", "Features")) for f in ln.split(":", 1)[1].split()}
    return bool(flags & NATIVE_BF16_FLAGS)


@functools.cache
def warn_slow_half_precision(dtype: str) -> None:
    log.warning(
        "model.dtype=%s on a CPU without native bf16 (no avx512_bf16/amx_bf16 flag): half-precision "
        "matmuls are emulated here and several times slower than float32; use model.dtype=auto",
        dtype,
    )


def compile_kernels(cc: str, sources: list[Path], out: Path | str, defines: tuple[str, ...] = ()) -> None:
    """The kernels' C sources into the shared library `out`, with the flags the package uses."""
    cmd = [cc, *FLAGS, *defines, *map(str, sources), "-o", str(out), "-lm"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)


def _build(cc: str, defines: tuple[str, ...] = ()) -> Path:
    flags = [*FLAGS, *defines]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    digest = hashlib.sha256()
    for part in [src.read_bytes() for src in sorted(KERNEL_DIR.glob("*.[ch]"))] + [
        version.encode(),
        " ".join(flags).encode(),
        _cpu_id().encode(),
    ]:
        digest.update(part)
    lib = cache_root() / "kernels" / f"rlserve-kernels-{digest.hexdigest()[:16]}.so"
    if lib.exists():
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes starting together never load a half-written file
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
    os.close(fd)
    try:
        compile_kernels(cc, SOURCES, tmp, defines)
        os.replace(tmp, lib)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


class CpuKernels:
    """The compiled library. Every tensor argument of one call has the same dtype (fp32 or bf16;
    the instance is picked by it) and contiguous rows (checked by the model's shapes, not here:
    these run 100+ times a step)."""

    def __init__(self, lib: ctypes.CDLL):
        i64, ptr, f32, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
        self._attention, self._add_rms_norm, self._qk_rope_store, self._silu_mul = {}, {}, {}, {}
        self._gemv, self._gemv_f32out, self._decode = {}, {}, {}
        self._gemm_packed_bytes, self._gemm_pack, self._gemm_packed, self._gemm_vectorized = {}, {}, {}, {}
        self._attention_lanes = {}
        for dtype, suffix in DTYPES.items():
            fn = lambda name, suffix=suffix: getattr(lib, f"rlserve_{name}_{suffix}")  # noqa: E731
            self._attention[dtype] = self._fn(fn("paged_attention"), [ptr, i64] + [ptr] * 5 + [i64] * 6 + [f32, i32])
            self._add_rms_norm[dtype] = self._fn(fn("add_rms_norm"), [ptr] * 4 + [i64] * 2 + [f32, i32])
            self._qk_rope_store[dtype] = self._fn(
                fn("qk_rope_store"), [ptr] * 5 + [f32] + [ptr] * 3 + [i64] * 4 + [i32]
            )
            self._silu_mul[dtype] = self._fn(fn("silu_mul"), [ptr, ptr, i64, i64, i32])
            self._gemv[dtype] = self._fn(fn("gemv"), [ptr] * 4 + [i64] * 3 + [i32])
            self._gemv_f32out[dtype] = self._fn(fn("gemv_f32out"), [ptr] * 4 + [i64] * 3 + [i32])
            self._gemm_packed_bytes[dtype] = self._fn(fn("gemm_packed_bytes"), [i64] * 2, i64)
            self._gemm_pack[dtype] = self._fn(fn("gemm_pack"), [ptr, i64, i64, ptr, i32])
            self._gemm_packed[dtype] = self._fn(fn("gemm_packed"), [ptr] * 4 + [i32] + [i64] * 3 + [i32])
            self._gemm_vectorized[dtype] = int(self._fn(fn("gemm_vectorized"), [], i32)())  # its vector bits
            self._attention_lanes[dtype] = int(self._fn(fn("paged_attention_lanes"), [], i32)())  # prompt tiles' bits
            self._decode[dtype] = self._fn(
                fn("decode_layers"),
                [ptr, i64] + [ptr] * 7 + [i64] + [ptr] * 2 + [i64] * 2 + [ptr] * 5 + [i64] * 6 + [f32, f32, i32, i32],
            )
        self._sample = self._fn(lib.rlserve_sample, [ptr, ptr, i64, i64, ptr, ptr, i32])
        self.decode_layer_ptrs = self._fn(lib.rlserve_decode_layer_ptrs, [], ctypes.c_int)()
        self._limits = self._fn(lib.rlserve_paged_attention_limits, [i64] * 3, ctypes.c_int)

    @staticmethod
    def _fn(fn, argtypes, restype=None):
        fn.argtypes, fn.restype = argtypes, restype
        return fn

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        return dtype in DTYPES and bool(self._limits(num_heads // num_kv_heads, head_dim, block_size))

    def attention(self, q, k_cache, v_cache, blocks, ctx_lens, block_size: int, scale: float) -> torch.Tensor:
        """q [B, H, D] (rows may be strided: a view into the QKV rows); caches [slots, KVH, D];
        blocks [B, W] int64; ctx_lens [B] int64 -> [B, H, D]."""
        b, h, d = q.shape
        assert q.stride(2) == 1 and q.stride(1) == d, "each row's heads must be contiguous"
        out = q.new_empty(b, h, d)
        self._attention[q.dtype](
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), blocks.data_ptr(), ctx_lens.data_ptr(),
            out.data_ptr(), b, blocks.shape[1], h, k_cache.shape[1], d, block_size, scale, torch.get_num_threads(),
        )  # fmt: skip
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
    ) -> None:
        """hidden += delta (the residual stream, in place); out = RMSNorm(hidden) * weight."""
        rows, dim = hidden.shape
        delta = None if delta is None else delta.contiguous()  # a swapped GEMM's output is a transposed view
        self._add_rms_norm[hidden.dtype](
            hidden.data_ptr(), _ptr(delta), weight.data_ptr(), out.data_ptr(), rows, dim, eps, torch.get_num_threads()
        )

    def qk_rope_store(
        self,
        qkv,
        cos,
        sin_signed,
        q_norm,
        k_norm,
        eps: float,
        slots,
        k_cache,
        v_cache,
        num_heads: int,
        num_kv_heads: int,
    ) -> None:
        """In place on qkv [T, (H + 2 KVH) * D]: per-head q/k RMSNorm (when given), RoPE on q and k;
        then k and v written to their KV slots."""
        d = k_cache.shape[-1]
        self._qk_rope_store[qkv.dtype](
            qkv.data_ptr(), cos.data_ptr(), sin_signed.data_ptr(), _ptr(q_norm), _ptr(k_norm), eps, slots.data_ptr(),
            k_cache.data_ptr(), v_cache.data_ptr(), qkv.shape[0], num_heads, num_kv_heads, d, torch.get_num_threads(),
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(rows, inter)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, inter, torch.get_num_threads())
        return out

    def sample(self, logits: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [rows, vocab] fp32, u [rows] fp32 (a row's uniform in [0, 1), negative: greedy) ->
        (tokens [rows] int64, log-sum-exp [rows, 1] fp32): each row's token drawn by inverse CDF from
        softmax(logits), or its first argmax where greedy (sample.c)."""
        rows, vocab = logits.shape
        tokens, lse = torch.empty(rows, dtype=torch.int64), torch.empty(rows, 1)
        self._sample(
            logits.data_ptr(), u.data_ptr(), rows, vocab, tokens.data_ptr(), lse.data_ptr(), torch.get_num_threads()
        )
        return tokens, lse

    def gemv_rows(self, dtype: torch.dtype) -> int:
        """Up to how many rows `gemv` is faster than the GEMM libraries (0: not for this dtype; bf16
        only where the CPU has native bf16 dot products, measured nowhere else)."""
        if dtype == torch.bfloat16 and not cpu_has_native_bf16():
            return 0
        return GEMV_MAX_ROWS.get(dtype, 0)

    def decode_layers(self, layer_ptrs: torch.Tensor, final_norm, h, x, cos, sin_signed, slots, kv, blocks, ctx_lens, block_size: int,
                      shape, eps: float, scale: float) -> None:  # fmt: skip
        """Every decoder layer of a decode step of few rows in one call (decode_impl.h): h [rows,
        hidden] the residual stream, updated in place; x ends as the final norm of it. layer_ptrs
        [layers, decode_layer_ptrs] int64 (see decode_impl.h); kv [layers, 2, slots, kv_heads, D]."""
        rows, hidden = h.shape
        nh, nkv, d, inter = shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.intermediate_size
        qkv, attn = h.new_empty(rows, (nh + 2 * nkv) * d), h.new_empty(rows, nh * d)
        delta, gate_up, act = h.new_empty(rows, hidden), h.new_empty(rows, 2 * inter), h.new_empty(rows, inter)
        threads = torch.get_num_threads()
        self._decode[h.dtype](
            layer_ptrs.data_ptr(), layer_ptrs.shape[0], final_norm.data_ptr(), h.data_ptr(), x.data_ptr(), cos.data_ptr(),
            sin_signed.data_ptr(), slots.data_ptr(), kv.data_ptr(), kv.shape[2], blocks.data_ptr(), ctx_lens.data_ptr(),
            blocks.shape[1], block_size, qkv.data_ptr(), attn.data_ptr(), delta.data_ptr(), gate_up.data_ptr(),
            act.data_ptr(), rows, hidden, nh, nkv, d, inter, eps, scale, threads, GEMV_THREADS or threads,
        )  # fmt: skip

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        threads: int | None = None,
        fp32_out: bool = False,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, K] @ weight[N, K]^T (+ bias [N]) -> [rows, N]: F.linear for a few rows, split
        over `threads` (default GEMV_THREADS) when the call has PARALLEL_MIN_WORK multiply-adds.
        fp32_out: the fp32 sums, unrounded (for bf16: an fp32 linear over the widened values).
        packed: `gemm_pack(weight)`, current (the row-invariant GEMM's sums, read from the panels)."""
        x, weight = x.contiguous(), weight.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32 if fp32_out else x.dtype)
        threads = threads or GEMV_THREADS or torch.get_num_threads()
        if packed is not None:
            self._gemm_packed[x.dtype](
                x.data_ptr(), packed.data_ptr(), _ptr(bias), out.data_ptr(), fp32_out, x.shape[0], x.shape[1], weight.shape[0], threads,
            )  # fmt: skip
            return out
        (self._gemv_f32out if fp32_out else self._gemv)[x.dtype](
            x.data_ptr(), weight.data_ptr(), _ptr(bias), out.data_ptr(), x.shape[0], x.shape[1], weight.shape[0], threads,
        )  # fmt: skip
        return out

    def panels_beat_the_libraries(self, dtype: torch.dtype) -> bool:
        """Whether projections in `dtype` run faster through gemm_impl.h's packed panels than through
        the GEMV and MKL's or oneDNN's packed weights at every row count (SmolLM2-135M's projections and
        LM head, weights streamed from memory, 2 cores). The AVX-512 form (bf16: with AVX512_BF16):
        1.1-1.2x from 1 to 128 rows and level at 2,048, fp32 and bf16. The AVX2 form, fp32: 1.5-1.9x
        the GEMV at 1-8 rows (what the engine ran there) and 1.0-1.2x MKL's packed weights from 32 to
        2,048 rows; bf16 is emulated there and was not measured."""
        bits = self._gemm_vectorized.get(dtype, 0)
        if bits == 512:
            return dtype != torch.bfloat16 or cpu_has_native_bf16()
        return bits == 256 and dtype == torch.float32

    def attention_lanes(self, dtype: torch.dtype) -> int:
        """The vector bits of the lanes form a prompt tile of this dtype takes: 512 (AVX-512), 256
        (AVX2 + FMA, fp32, the default build) or 0 (none: the per-query form)."""
        return self._attention_lanes.get(dtype, 0)

    def prompt_tiles_beat_sdpa(self, dtype: torch.dtype) -> bool:
        """Whether prompt attention runs faster through the paged kernel's row tiles than through torch's
        SDPA: where the tiles have a lanes form (engine/runner.py has the figures), AVX-512 in both
        dtypes (bf16 with native bf16) and AVX2 + FMA in fp32."""
        bits = self.attention_lanes(dtype)
        return bits == 256 or (bits == 512 and self.panels_beat_the_libraries(dtype))

    def gemm_packed_bytes(self, weight: torch.Tensor) -> int:
        return self._gemm_packed_bytes[weight.dtype](weight.shape[1], weight.shape[0])

    def gemm_pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """weight [N, K] in gemm_impl.h's panel layout (a uint8 buffer; `out` reused when its size
        fits): `gemv(..., packed=)` then sums exactly as the row-invariant build's GEMV does."""
        n, k = weight.shape
        size = self.gemm_packed_bytes(weight)
        if out is None or out.numel() != size:
            out = torch.empty(size, dtype=torch.uint8)
        self._gemm_pack[weight.dtype](weight.contiguous().data_ptr(), k, n, out.data_ptr(), torch.get_num_threads())
        return out


def reference_paged_attention(q, k_cache, v_cache, blocks, ctx_lens, block_size: int, scale: float) -> torch.Tensor:
    """What the attention kernel computes, in torch: q [B, H, D], caches [slots, KVH, D],
    blocks [B, W], ctx_lens [B] -> [B, H, D]."""
    b, w = blocks.shape
    nkv, d = k_cache.shape[1], k_cache.shape[2]
    slots = (blocks.unsqueeze(2) * block_size + torch.arange(block_size)).view(b, w * block_size)
    mask = (torch.arange(w * block_size) < ctx_lens.unsqueeze(1)).view(b, 1, 1, -1)
    out = F.scaled_dot_product_attention(
        q.reshape(b, nkv, -1, d),
        k_cache[slots].transpose(1, 2),
        v_cache[slots].transpose(1, 2),
        attn_mask=mask,
        scale=scale,
    )
    return out.reshape(q.shape)


@functools.cache
def cpu_kernels() -> CpuKernels | None:
    """The kernels, built and self-checked once per process; None where they cannot be had."""
    if platform.system() != "Linux" or os.environ.get("RLSERVE_NO_CPU_KERNELS"):
        return None
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler found (set CC); the CPU kernels are unavailable, using PyTorch ops")
        return None
    try:
        kernels = CpuKernels(ctypes.CDLL(str(_build(cc))))
        _self_check(kernels)
    except (OSError, subprocess.SubprocessError, AssertionError, AttributeError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("the CPU kernels are unavailable (%s); using PyTorch ops", detail)
        return None
    return kernels


def _self_check(kernels: CpuKernels) -> None:
    """Each kernel against the PyTorch ops it replaces, once per process: a build that computes
    something else is never used. Attention goes through a generic and a special-cased head size."""
    from rlserve.model.rope import apply_rope

    gen = torch.Generator().manual_seed(0)

    def check(name: str, got: torch.Tensor, want: torch.Tensor, atol: float = 1e-5) -> None:
        diff = (got.float() - want.float()).abs().max().item()
        assert diff <= atol, f"{name} ({got.dtype}) differs by {diff:.2e}"

    bs, nkv, group = 4, 2, 3
    blocks = torch.tensor([[3, 7, 1], [5, 0, 0], [11, 2, 9]])
    ctx_lens = torch.tensor([10, 1, 12])
    for d in (16, 64):
        k_cache, v_cache = torch.randn(2, 12 * bs, nkv, d, generator=gen).unbind(0)
        q = torch.randn(3, nkv * group, d, generator=gen)
        got = kernels.attention(q, k_cache.contiguous(), v_cache.contiguous(), blocks, ctx_lens, bs, 0.25)
        check("attention", got, reference_paged_attention(q, k_cache, v_cache, blocks, ctx_lens, bs, 0.25))
        q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16().contiguous(), v_cache.bfloat16().contiguous()
        want = reference_paged_attention(q.float(), k_cache.float(), v_cache.float(), blocks, ctx_lens, bs, 0.25)
        check("attention", kernels.attention(q, k_cache, v_cache, blocks, ctx_lens, bs, 0.25), want, atol=2e-2)
    # a prompt's rows, taken as tiles of consecutive positions over one table
    rows = 20
    k_cache, v_cache = torch.randn(2, 12 * bs, nkv, 64, generator=gen).unbind(0)
    q = torch.randn(rows, nkv * group, 64, generator=gen)
    tables, lens = torch.tensor([[4, 2, 9, 0, 7]]).expand(rows, -1).contiguous(), torch.arange(1, rows + 1)
    want = reference_paged_attention(q, k_cache, v_cache, tables, lens, bs, 0.25)
    check(
        "prompt attention",
        kernels.attention(q, k_cache.contiguous(), v_cache.contiguous(), tables, lens, bs, 0.25),
        want,
    )

    hidden, delta, weight = torch.randn(3, 3, 40, generator=gen).unbind(0)
    out, want = torch.empty_like(hidden), F.rms_norm(hidden + delta, (40,), weight[0], 1e-6)
    kernels.add_rms_norm(hidden, delta, weight[0], out, 1e-6)
    check("add_rms_norm", out, want)
    hidden, delta, weight = hidden.bfloat16(), delta.bfloat16(), weight.bfloat16()
    out, want = torch.empty_like(hidden), F.rms_norm((hidden + delta).float(), (40,), weight[0].float(), 1e-6)
    kernels.add_rms_norm(hidden, delta, weight[0], out, 1e-6)
    check("add_rms_norm", out, want, atol=0.1)
    gate_up = torch.randn(3, 80, generator=gen)
    check("silu_mul", kernels.silu_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])
    x, weight, bias = (
        torch.randn(5, 37, generator=gen),
        torch.randn(9, 37, generator=gen),
        torch.randn(9, generator=gen),
    )
    check("gemv", kernels.gemv(x, weight, bias), F.linear(x, weight, bias), atol=1e-4)
    want = F.linear(x.bfloat16().float(), weight.bfloat16().float(), bias.bfloat16().float())
    check("gemv", kernels.gemv(x.bfloat16(), weight.bfloat16(), bias.bfloat16()), want, atol=0.1)

    nh, d = nkv * group, 16
    qkv, angles = torch.randn(2, nh + 2 * nkv, d, generator=gen), torch.rand(2, 1, d // 2, generator=gen)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    want = apply_rope(qkv[:, : nh + nkv], cos, sin)
    k_cache, v_cache = torch.zeros(2, 5, nkv, d).unbind(0)
    kernels.qk_rope_store(qkv.view(2, -1), cos, sin, None, None, 1e-6, torch.tensor([4, 1]), k_cache, v_cache, nh, nkv)
    stored = torch.cat((qkv[:, : nh + nkv], k_cache[[4, 1]], v_cache[[4, 1]]), 1)
    check("qk_rope_store", stored, torch.cat((want, want[:, nh:], qkv[:, nh + nkv :]), 1))
