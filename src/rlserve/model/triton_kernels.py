"""Batch-invariant mode on a GPU: the model's row-wise arithmetic as Triton kernels.

The same interface as the CPU kernels' invariant build (`InvariantKernels`: `gemv`, `attention`,
`add_rms_norm`, `qk_rope_store`, `silu_mul`), so `CausalLM`, the engine's invariant mode and the
trainer's mirror run unchanged on CUDA. What makes a row's bits independent of its batch:
- the projections are one Triton GEMM at every row count, its tile sizes fixed per dtype (never
  chosen by the row count, no split-K): each output is its tile's K loop over one row, whichever
  tile the row lands in and whatever rows share it. cuBLAS picks kernels and split-K by shape.
- attention is one program per (token, KV head), an online softmax over the token's own context in
  block-size steps from position 0, as the CPU's paged decode kernel walks it: a prompt token is
  computed as if decoded (`engine/invariant.token_rows` lays the step out so).
- RMSNorm, and q/k norm + RoPE + the KV write: one program per token, each reduction over one row's
  (one head's) values.
Element-wise steps (SiLU x up) are torch's element-wise kernels: per element, whatever the shape.
`invariant_ops.invariant_kernels` checks the row independence on the device once per process.

Without a GPU, `TRITON_INTERPRET=1` runs these kernels on CPU tensors through Triton's interpreter
(how the GPU path is tested on CPU machines). The interpreter's dot is numpy's matmul, whose sums
follow a row's place in the tile and which takes bf16 operands as raw bits, so the interpreted GEMM
sums its products over K with `tl.sum` instead (in K order, each output on its own). Its bf16
arithmetic and rounding are not the GPU's either (it truncates), so every kernel computes in fp32
and rounds to bf16 by hand (`_round_to`: to nearest even, as the GPU's conversion does): the same
bits under both.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU-only install; `available()` says so
    triton = tl = None

DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 256
MAX_BLOCK_SIZE = 128


# whether Triton runs the kernels below through its interpreter on CPU tensors: it reads TRITON_INTERPRET when it
# defines them, so it is read here once too (invariant_ops reads it before importing this module, and Triton)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def available() -> bool:
    return triton is not None


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


if triton is not None:

    @triton.jit
    def _round_to(x, dtype: tl.constexpr):
        """fp32 x in `dtype`, rounded to nearest even by hand for bf16 (then the conversion is exact)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        return x.to(dtype)

    @triton.jit(do_not_specialize=["rows"])
    def _gemm_rows(x, w, bias, out, rows, n, k, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, DOT: tl.constexpr):  # fmt: skip
        """out[rows, n] = x[rows, k] @ w[n, k]^T (+ bias): fp32 sums over K in BLOCK_K steps, in order."""
        rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: rows x K may pass 2^31
        rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x + rm[:, None] * k + rk[None, :], mask=(rm[:, None] < rows) & (rk[None, :] < k), other=0.0)
            b = tl.load(w + rn[None, :] * k + rk[:, None], mask=(rn[None, :] < n) & (rk[:, None] < k), other=0.0)
            if DOT == "sum":  # the interpreter's form
                acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
            elif DOT == "ieee":  # fp32 operands: IEEE products and sums (no TF32)
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            acc += tl.load(bias + rn, mask=rn < n, other=0.0).to(tl.float32)[None, :]
        mask = (rm[:, None] < rows) & (rn[None, :] < n)
        tl.store(out + rm[:, None] * n + rn[None, :], _round_to(acc, out.dtype.element_ty), mask=mask)

    @triton.jit
    def _add_rms_norm_rows(hidden, delta, weight, out, dim, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
        """hidden[row] += delta[row] (rounded to the model's dtype); out[row] = RMSNorm(hidden[row]) * weight."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < dim
        dtype = hidden.dtype.element_ty
        x = tl.load(hidden + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DELTA:
            x += tl.load(delta + row * dim + cols, mask=mask, other=0.0).to(tl.float32)
            x = _round_to(x, dtype).to(tl.float32)
            tl.store(hidden + row * dim + cols, x.to(dtype), mask=mask)
        inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / dim + eps)
        w = tl.load(weight + cols, mask=mask, other=0.0).to(tl.float32)
        normed = _round_to(x * inv, dtype).to(tl.float32)  # transformers: weight * hidden.to(input_dtype)
        tl.store(out + row * dim + cols, _round_to(normed * w, dtype), mask=mask)

    @triton.jit
    def _qk_rope_store_rows(qkv, cos, sin_signed, q_norm, k_norm, eps, slots, k_cache, v_cache, num_heads,
                            num_kv_heads, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_H: tl.constexpr,
                            HAS_NORM: tl.constexpr):  # fmt: skip
        """One token of qkv [T, (H + 2 KVH) * D], all its heads as the rows of one tile: q and k heads
        normed (when given) and rotated in place, k and v heads written to the token's KV slot."""
        t = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        dtype = qkv.dtype.element_ty
        heads = num_heads + 2 * num_kv_heads
        is_q = head < num_heads
        is_k = (head >= num_heads) & (head < num_heads + num_kv_heads)
        is_v = (head >= num_heads + num_kv_heads) & (head < heads)
        d_mask = d < D
        rotated = (is_q | is_k) & d_mask
        row = qkv + (t * heads + head) * D
        slot = tl.load(slots + t)
        v_at = (slot * num_kv_heads + head - num_heads - num_kv_heads) * D + d
        tl.store(v_cache + v_at, tl.load(row + d, mask=is_v & d_mask), mask=is_v & d_mask)  # values as they are
        rolled = (d + D // 2) % D  # rotate_half(x) * sin == x[rolled] * sin_signed
        x = tl.load(row + d, mask=rotated, other=0.0).to(tl.float32)
        x_rolled = tl.load(row + rolled, mask=rotated, other=0.0).to(tl.float32)
        if HAS_NORM:
            inv = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / D + eps)[:, None]
            w = tl.where(is_q, tl.load(q_norm + d, mask=d_mask, other=0.0), tl.load(k_norm + d, mask=d_mask, other=0.0))
            w = w.to(tl.float32)
            w_rolled = tl.where(
                is_q, tl.load(q_norm + rolled, mask=d_mask, other=0.0), tl.load(k_norm + rolled, mask=d_mask, other=0.0)
            ).to(tl.float32)
            x = _round_to(_round_to(x * inv, dtype).to(tl.float32) * w, dtype).to(tl.float32)
            x_rolled = _round_to(_round_to(x_rolled * inv, dtype).to(tl.float32) * w_rolled, dtype).to(tl.float32)
        c = tl.load(cos + t * D + d, mask=d_mask, other=0.0).to(tl.float32)
        s = tl.load(sin_signed + t * D + d, mask=d_mask, other=0.0).to(tl.float32)
        y = _round_to(x * c + x_rolled * s, dtype)
        tl.store(row + d, y, mask=rotated)
        tl.store(k_cache + (slot * num_kv_heads + head - num_heads) * D + d, y, mask=is_k & d_mask)

    @triton.jit
    def _paged_attention_rows(q, q_row_stride, k_cache, v_cache, blocks, ctx_lens, out, width, num_heads,
                              num_kv_heads, scale, D: tl.constexpr, BLOCK_D: tl.constexpr, GROUP: tl.constexpr,
                              BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_S: tl.constexpr):  # fmt: skip
        """One (token, KV head): its GROUP query heads attend to positions [0, ctx_len) of the token's
        block table, one online-softmax step a block, in fp32."""
        row = tl.program_id(0).to(tl.int64)
        kvh = tl.program_id(1)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        s = tl.arange(0, BLOCK_S)
        g_mask, d_mask = g < GROUP, d < D
        heads = kvh * GROUP + g
        qv = tl.load(q + row * q_row_stride + heads[:, None] * D + d[None, :],
                     mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)  # fmt: skip
        ctx = tl.load(ctx_lens + row)
        best = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        total = tl.zeros((BLOCK_G,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), dtype=tl.float32)
        for j in range(0, tl.cdiv(ctx, BLOCK_SIZE)):
            block = tl.load(blocks + row * width + j)
            pos = j * BLOCK_SIZE + s
            live = (s < BLOCK_SIZE) & (pos < ctx)
            kv_at = ((block * BLOCK_SIZE + s)[:, None] * num_kv_heads + kvh) * D + d[None, :]
            kv_mask = live[:, None] & d_mask[None, :]
            keys = tl.load(k_cache + kv_at, mask=kv_mask, other=0.0).to(tl.float32)
            values = tl.load(v_cache + kv_at, mask=kv_mask, other=0.0).to(tl.float32)
            scores = tl.sum(qv[:, None, :] * keys[None, :, :], axis=2) * scale  # [G, S]
            scores = tl.where(live[None, :], scores, float("-inf"))
            new_best = tl.maximum(best, tl.max(scores, axis=1))
            p = tl.exp(scores - new_best[:, None])
            keep = tl.exp(best - new_best)
            total = total * keep + tl.sum(p, axis=1)
            acc = acc * keep[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
            best = new_best
        o = acc / total[:, None]
        tl.store(out + (row * num_heads + heads[:, None]) * D + d[None, :], _round_to(o, out.dtype.element_ty),
                 mask=g_mask[:, None] & d_mask[None, :])  # fmt: skip


# Every multiply and add rounded as written, whatever Triton's default (3.9 contracts them into FMAs, 3.10 will
# not): a trainer and a server on different Triton versions compute the same bits, and the GPU's element-wise
# arithmetic is the interpreter's. (tl.dot keeps its own fused sums.)
LAUNCH = {"enable_fp_fusion": False}

# Tile sizes of the projections' GEMM, fixed per dtype: a row's sums must not follow the row count.
# bf16 runs on tensor cores; fp32 is IEEE (FMA) and takes smaller tiles. Not tuned on a GPU yet.
GEMM_TILES = {torch.bfloat16: (64, 64, 64), torch.float32: (32, 32, 32)}
INTERPRETED_TILES = (16, 256, 32)


class TritonKernels:
    """The kernels batch-invariant mode runs on a GPU (or on CPU under TRITON_INTERPRET=1); every
    tensor argument on one device, in one dtype (fp32 or bf16)."""

    row_invariant = True

    def supports(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype) -> bool:
        return dtype in DTYPES and head_dim <= MAX_HEAD_DIM and block_size <= MAX_BLOCK_SIZE

    def gemv_rows(self, dtype: torch.dtype) -> int:
        return sys.maxsize if dtype in DTYPES else 0  # the GEMM at every row count

    def panels_beat_the_libraries(self, dtype: torch.dtype) -> bool:
        return False

    def prompt_tiles_beat_sdpa(self, dtype: torch.dtype) -> bool:
        return False

    def gemm_packed_bytes(self, weight: torch.Tensor) -> int:
        return 0

    def gemm_pack(self, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight as `gemv(packed=)` reads it: the weight itself (the GEMM tiles it as stored)."""
        return weight.contiguous()

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        threads: int | None = None,
        fp32_out: bool = False,
        packed: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [rows, K] @ weight [N, K]^T (+ bias) -> [rows, N] in x's dtype (fp32 with `fp32_out`)."""
        x, weight = x.contiguous(), (weight if packed is None else packed).contiguous()
        rows, k = x.shape
        n = weight.shape[0]
        out = x.new_empty(rows, n, dtype=torch.float32 if fp32_out else x.dtype)
        if rows == 0:
            return out
        bm, bn, bk = INTERPRETED_TILES if INTERPRETED else GEMM_TILES[x.dtype]
        dot = "sum" if INTERPRETED else "ieee" if x.dtype == torch.float32 else "mma"
        grid = (triton.cdiv(rows, bm), triton.cdiv(n, bn))
        _gemm_rows[grid](
            x, weight, x if bias is None else bias, out, rows, n, k, bm, bn, bk, bias is not None, dot, **LAUNCH
        )
        return out

    def add_rms_norm(
        self, hidden: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor, eps: float
    ) -> None:
        """hidden += delta (the residual stream, in place); out = RMSNorm(hidden) * weight."""
        rows, dim = hidden.shape
        delta = None if delta is None else delta.contiguous()
        _add_rms_norm_rows[(rows,)](
            hidden, hidden if delta is None else delta, weight, out, dim, eps, delta is not None, _pow2(dim), **LAUNCH
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
        t = qkv.shape[0]
        if t == 0:
            return
        norm = q_norm is not None
        _qk_rope_store_rows[(t,)](
            qkv, cos.contiguous(), sin_signed.contiguous(), q_norm if norm else qkv, k_norm if norm else qkv, eps,
            slots, k_cache, v_cache, num_heads, num_kv_heads, d, _pow2(d), _pow2(num_heads + 2 * num_kv_heads), norm,
            **LAUNCH,
        )  # fmt: skip

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def attention(self, q, k_cache, v_cache, blocks, ctx_lens, block_size: int, scale: float) -> torch.Tensor:
        """q [B, H, D] (rows may be strided); caches [slots, KVH, D]; blocks [B, W]; ctx_lens [B] -> [B, H, D]."""
        b, h, d = q.shape
        assert q.stride(2) == 1 and q.stride(1) == d, "each row's heads must be contiguous"
        nkv = k_cache.shape[1]
        group = h // nkv
        out = q.new_empty(b, h, d)
        if b == 0:
            return out
        _paged_attention_rows[(b, nkv)](
            q, q.stride(0), k_cache, v_cache, blocks.contiguous(), ctx_lens, out, blocks.shape[1], h, nkv, scale,
            d, _pow2(d), group, max(_pow2(group), 2), block_size, _pow2(block_size), **LAUNCH,
        )  # fmt: skip
        return out


@functools.cache
def triton_kernels() -> TritonKernels | None:
    return TritonKernels() if available() else None
