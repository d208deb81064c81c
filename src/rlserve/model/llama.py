"""One Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

Projections are fused (one QKV matmul, one gate-up matmul): fewer, larger matmuls are the main
lever on CPU. Arithmetic order follows transformers so logprobs match its forward pass.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model.moe import MoeShape, SparseMoe

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels
    from rlserve.model.lora import LoraBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    moe: MoeShape | None = None  # Qwen3-MoE: the expert blocks

    @classmethod
    def from_hf(cls, cfg) -> "ModelShape":
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
            raise ValueError(f"model_type {model_type!r} is not supported; rlserve serves llama, mistral, qwen2, qwen3 and qwen3_moe")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope_scaling = getattr(cfg, "rope_scaling", None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default", "llama3"):
            raise ValueError(f"rope_scaling {rope_scaling} is not supported")
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_scaling=rope_scaling if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3" else None,
            moe=MoeShape.from_hf(cfg, cfg.num_hidden_layers) if model_type == "qwen3_moe" else None,
        )


@dataclass(slots=True)
class PrefillSeq:
    """One sequence's chunk in a step: query rows [q_start, q_start + q_len) of the packed batch."""

    q_start: int
    q_len: int
    ctx_len: int  # tokens of context the chunk attends to, including itself
    ctx_slots: torch.Tensor | None  # KV slots of the whole context; None when the chunk is the whole context
    mask: torch.Tensor | None = None  # [q_len, ctx_len] causal mask past a cached prefix (with ctx_slots)


@dataclass(slots=True)
class CascadePlan:
    """Decode attention split in two for sequences that share leading KV blocks (n samples of one
    prompt, or requests whose prompts hit the same cached prefix): each group's queries attend to
    the shared prefix together, gathered once, then each sequence to the rest of its own context;
    the halves are merged by their log-sum-exp. Grouped rows come first in the batch, each group's
    rows together; groups are padded to the same width."""

    prefix_blocks: torch.Tensor  # [groups * prefix_width] shared blocks of each group, padded
    prefix_mask: torch.Tensor | None  # [groups, 1, 1, prefix_width * block_size] additive; None = no padding
    group_width: int  # most members in a group
    num_grouped: int  # decode rows [0, num_grouped) belong to a group
    # decode row of each group member, padding rows point at row num_grouped; None when every
    # group is full width (the grouped rows are then exactly [0, groups * group_width))
    query_rows: torch.Tensor | None
    suffix_blocks: torch.Tensor  # [B * suffix_width] each sequence's blocks after its group's prefix
    suffix_mask: torch.Tensor  # [B, 1, 1, suffix_width * block_size] additive


@dataclass(slots=True)
class AttentionBatch:
    """Where each token's K/V goes and what each query attends to. Decode rows come first."""

    slot_mapping: torch.Tensor  # [T] KV slot of every token in the step
    num_decode: int
    # [num_decode * width] each decode sequence's KV blocks, padded; gathered whole blocks at a
    # time (large contiguous copies), positions past a sequence's context masked out
    decode_blocks: torch.Tensor | None
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, width * block_size] True = attend; None with kernels
    decode_lens: torch.Tensor | None  # [num_decode] context length of each decode row
    cascade: CascadePlan | None
    prefills: list[PrefillSeq]
    block_size: int = 16
    lora: "LoraBatch | None" = None  # adapters by row group, when any request in the step uses one
    # C kernels for decode attention and the element-wise steps (cpu_kernels.py); None = PyTorch ops
    kernels: "CpuKernels | None" = None


# MKL's CPU sgemm computes x @ W^T 1.3-1.9x faster for 5 to 56 rows of x when it is asked for
# (W @ x^T)^T: for the row-major x @ W^T form with few rows it picks a poor blocking (measured with
# torch 2.13's MKL on AVX-512 for every projection shape of a SmolLM2-135M; at 1-4 rows and from
# 57 rows the plain form is as fast or faster). The result is a transposed view. Only for weights
# that are not packed (see PackedWeight).
SWAPPED_GEMM_ROWS = range(5, 57)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] in SWAPPED_GEMM_ROWS:
        out = torch.mm(weight, x.t()).t()
        return out if bias is None else out + bias
    return F.linear(x, weight, bias)


class PackedWeight:
    """A CPU weight kept a second time in its GEMM library's packed layout: oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`) for bf16 and, where oneDNN is there, for fp32; else fp32 in
    MKL's (`cblas_sgemm_pack`).

    Plain sgemm repacks the whole weight on every call; at decode batch sizes that pass costs as
    much as the multiply. Packed once, the SmolLM2-135M projections run 1.3-2.3x faster at 4-64
    rows and as fast at 1-3 (2 cores, AVX-512), the vocabulary projection 1.5x at 64 rows; bf16
    through oneDNN's packed weight 1.2-2x faster than bf16 `F.linear` (AVX512_BF16), with the same
    bits. fp32 through oneDNN: 2.0x MKL's packed sgemm at 64 rows, 1.3-2.6x from 9 to 512 rows (2
    cores of an AMD EPYC with AVX-512, the projections of SmolLM2-135M; strict fp32, no bf16 inside).
    The copy costs one more weight's memory. It is rebuilt when the weight changes in place (weight
    updates bump its version counter) or is replaced."""

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._onednn = False  # the library that packed it, and so the one that multiplies with it

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu":
            return False
        if weight.dtype == torch.bfloat16:
            return _onednn_packing_works(torch.bfloat16)
        return weight.dtype == torch.float32 and (_onednn_packing_works(torch.float32) or _mkl_packing_works())

    def refresh(self, weight: torch.Tensor) -> None:
        """Repack if the weight changed since the last pack (~0.15 s for a 135M model's weights)."""
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            self._onednn = weight.dtype == torch.bfloat16 or _onednn_packing_works(torch.float32)
            if self._onednn:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64)
            else:
                self._packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), 64)
            self._key = key

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.refresh(weight)
        if self._onednn:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
        # the op uses the packed weight only when told the real row count; else it falls back
        return torch.ops.mkl._mkl_linear(x, self._packed, weight, bias, x.shape[0])


@functools.cache
def _mkl_packing_works() -> bool:
    """MKL documents a packed matrix for the row count it was packed with; rlserve reuses one for
    every row count, which holds for the layouts MKL uses (B panels do not depend on M). Checked
    once per process against plain sgemm, so a build where it does not hold falls back."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 200, generator=gen), torch.randn(300, generator=gen)
    packed = PackedWeight()
    for rows in (1, 3, 17, 64, 200):
        x = torch.randn(rows, 200, generator=gen)
        if not torch.allclose(packed.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4):
            log.warning("MKL packed sgemm disagrees with sgemm at %d rows; projections stay unpacked", rows)
            return False
    return True


@functools.cache
def _onednn_packing_works(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear in `dtype`, checked once per process against `F.linear` (bf16: the
    same bits expected; fp32: fp32 rounding, no bf16 inside); a build where it differs or lacks the
    ops keeps MKL (fp32) or plain `F.linear` (bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 200, generator=gen).to(dtype), torch.randn(300, generator=gen).to(dtype)
    atol = 0.25 if dtype == torch.bfloat16 else 1e-4
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        for rows in (1, 3, 17, 64, 200):
            x = torch.randn(rows, 200, generator=gen).to(dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            if not torch.allclose(got.float(), F.linear(x, weight, bias).float(), atol=atol):
                log.warning("oneDNN packed %s linear disagrees with F.linear at %d rows; not using it", dtype, rows)
                return False
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN packed %s linear is unavailable (%s); not using it", dtype, exc)
        return False
    return True


class CastWeight:
    """A copy of a weight in another dtype (the fp32 LM head of a bf16 model), kept in one buffer
    and refreshed in place when the weight changes, so a packed copy of it sees the change too."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._copy: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = (weight.data_ptr(), weight._version)
        if key != self._key:
            if self._copy is None or self._copy.shape != weight.shape or self._copy.device != weight.device:
                self._copy = weight.detach().to(self.dtype)
            else:
                self._copy.copy_(weight.detach())
            self._key = key
        return self._copy


class Projection(nn.Linear):
    """nn.Linear that runs through a packed copy of its weight once `pack()` has made one, and
    through the C GEMV for a few rows once `CausalLM.use_gemv` has given it the kernels."""

    packed: PackedWeight | None = None
    gemv: "CpuKernels | None" = None

    def pack(self) -> bool:
        self.packed = PackedWeight() if PackedWeight.supported(self.weight) else None
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gemv is not None and x.shape[0] <= self.gemv.gemv_rows(x.dtype) and x.dtype == self.weight.dtype:
            return self.gemv.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return self.packed.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


class RotaryEmbedding(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device):
        super().__init__()
        dim = shape.head_dim
        with torch.device("cpu"):  # real tables even when the module is built on the meta device
            inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            if shape.rope_scaling:
                inv_freq = _llama3_scale(inv_freq, shape.rope_scaling)
            positions = torch.arange(shape.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

        # rotate_half(x) * sin == roll(x, half) * sin_signed: one op fewer per application
        half = dim // 2
        self.register_buffer("sin_signed", torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the step's positions, [T, 1, head_dim]; computed once per step."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_signed.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    import math

    factor, low, high = cfg["factor"], cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, shape.head_dim
        self.q_size, self.kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.qkv_proj = Projection(shape.hidden_size, self.q_size + 2 * self.kv_size, bias=shape.qkv_bias)
        self.o_proj = Projection(self.q_size, shape.hidden_size, bias=False)
        self.eps = shape.rms_norm_eps
        if shape.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(shape.head_dim))
            self.k_norm = nn.Parameter(torch.ones(shape.head_dim))
        else:
            self.q_norm = self.k_norm = None
        self.scale = shape.head_dim**-0.5
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums the ranks' o_proj outputs

    def forward(self, x, rope: tuple[torch.Tensor, torch.Tensor], batch: AttentionBatch, kv: torch.Tensor):
        t, nh, nkv = x.shape[0], self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x)
        if batch.lora is not None:
            batch.lora.apply(qkv, x, self.layer, ("q_proj", "k_proj", "v_proj"))
        k_cache, v_cache = kv[0], kv[1]  # [slots, kv_heads, head_dim]
        if batch.kernels is not None:  # the same steps, in place on qkv, in one C call
            qkv = qkv.contiguous()  # the swapped GEMM of unpacked weights returns a transposed view
            heads = qkv.view(t, nh + 2 * nkv, self.head_dim)
            cos, sin = rope
            batch.kernels.qk_rope_store(qkv, cos, sin, self.q_norm, self.k_norm, self.eps, batch.slot_mapping, k_cache, v_cache, nh, nkv)
            q, k, v = heads[:, :nh], heads[:, nh : nh + nkv], heads[:, nh + nkv :]
        else:
            heads = qkv.reshape(t, nh + 2 * nkv, self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat((rms_norm(heads[:, :nh], self.q_norm, self.eps), rms_norm(heads[:, nh : nh + nkv], self.k_norm, self.eps)), 1)
            else:
                qk = heads[:, : nh + nkv]
            qk = apply_rope(qk, *rope)  # q and k in one pass
            q, k, v = qk[:, :nh], qk[:, nh:], heads[:, nh + nkv :]
            k_cache.index_copy_(0, batch.slot_mapping, k)
            v_cache.index_copy_(0, batch.slot_mapping, v)
        if not batch.prefills:
            out = self._decode(q, batch, k_cache, v_cache)
        elif not batch.num_decode and len(batch.prefills) == 1:
            out = self._prefill(q, k, v, batch.prefills[0], k_cache, v_cache)
        else:
            out = torch.empty_like(q)
            if batch.num_decode:
                out[: batch.num_decode] = self._decode(q[: batch.num_decode], batch, k_cache, v_cache)
            for p in batch.prefills:
                rows = slice(p.q_start, p.q_start + p.q_len)
                out[rows] = self._prefill(q[rows], k[rows], v[rows], p, k_cache, v_cache)
        out = out.reshape(t, self.q_size)
        o = self.o_proj(out)
        if batch.lora is not None:
            batch.lora.apply(o, out, self.layer, ("o_proj",))
        return o if self.reduce is None else self.reduce(o)

    def _decode(self, q, batch: AttentionBatch, k_cache, v_cache):
        if batch.cascade is not None:
            return self._decode_cascade(q, batch.cascade, batch.block_size, k_cache, v_cache)
        if batch.kernels is not None:
            blocks = batch.decode_blocks.view(q.shape[0], -1)
            return batch.kernels.attention(q, k_cache, v_cache, blocks, batch.decode_lens, batch.block_size, self.scale)
        b, block = q.shape[0], batch.block_size * self.num_kv_heads * self.head_dim
        keys = k_cache.view(-1, block).index_select(0, batch.decode_blocks).view(b, -1, self.num_kv_heads, self.head_dim)
        values = v_cache.view(-1, block).index_select(0, batch.decode_blocks).view(b, -1, self.num_kv_heads, self.head_dim)
        # the query heads sharing a KV head become that head's "query positions": one small
        # attention per KV head instead of expanding K/V for every query head (~1.6x faster on CPU)
        group = self.num_heads // self.num_kv_heads
        o = F.scaled_dot_product_attention(
            q.reshape(b, self.num_kv_heads, group, self.head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=batch.decode_mask,
            scale=self.scale,
        )
        return o.reshape(b, self.num_heads, self.head_dim)

    def _decode_cascade(self, q, plan: CascadePlan, block_size: int, k_cache, v_cache):
        b, nkv, d = q.shape[0], self.num_kv_heads, self.head_dim
        group, width, grouped = self.num_heads // nkv, plan.group_width, plan.num_grouped
        block = block_size * nkv * d
        # each sequence's own blocks
        keys = k_cache.view(-1, block).index_select(0, plan.suffix_blocks).view(b, -1, nkv, d).transpose(1, 2)
        values = v_cache.view(-1, block).index_select(0, plan.suffix_blocks).view(b, -1, nkv, d).transpose(1, 2)
        out, lse = _attention_with_lse(q.reshape(b, nkv, group, d), keys, values, plan.suffix_mask, self.scale)
        # shared prefixes: the query heads of a group's members become query positions of one attention
        if plan.query_rows is None:
            q_rows = q[:grouped]
        else:
            q_rows = torch.cat((q[:grouped], q.new_zeros(1, *q.shape[1:]))).index_select(0, plan.query_rows)
        g = q_rows.shape[0] // width
        q_prefix = q_rows.view(g, width, nkv, group, d).transpose(1, 2).reshape(g, nkv, width * group, d)
        keys = k_cache.view(-1, block).index_select(0, plan.prefix_blocks).view(g, -1, nkv, d).transpose(1, 2)
        values = v_cache.view(-1, block).index_select(0, plan.prefix_blocks).view(g, -1, nkv, d).transpose(1, 2)
        o_pre, lse_pre = _attention_with_lse(q_prefix, keys, values, plan.prefix_mask, self.scale)
        o_pre = o_pre.reshape(g, nkv, width, group, d).transpose(1, 2).reshape(g * width, nkv, group, d)
        lse_pre = lse_pre.reshape(g, nkv, width, group).transpose(1, 2).reshape(g * width, nkv, group)
        if plan.query_rows is not None:  # back to one row per grouped sequence
            o_pre = o_pre.new_empty(grouped + 1, nkv, group, d).index_copy_(0, plan.query_rows, o_pre)[:grouped]
            lse_pre = lse_pre.new_empty(grouped + 1, nkv, group).index_copy_(0, plan.query_rows, lse_pre)[:grouped]
        # softmax over both halves = the halves weighted by sigmoid of their log-sum-exp difference
        weight = (lse_pre - lse[:grouped]).sigmoid_().unsqueeze(-1)
        out[:grouped].lerp_(o_pre, weight)
        return out.reshape(b, self.num_heads, d)

    def _prefill(self, q, k, v, p: PrefillSeq, k_cache, v_cache):
        if p.ctx_slots is None:
            mask, causal = None, True
        else:
            k, v = k_cache.index_select(0, p.ctx_slots), v_cache.index_select(0, p.ctx_slots)
            mask, causal = p.mask, False
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=self.scale,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)


def _attention_with_lse(q, k, v, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns each query's log-sum-exp of scores ([B, H, L, D] and [B, H, L])."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, layer: int):
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Projection(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = Projection(shape.intermediate_size, shape.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # tensor parallel: sums the ranks' down_proj outputs

    def forward(self, x, lora: "LoraBatch | None", kernels: "CpuKernels | None" = None):
        gate_up = self.gate_up_proj(x)
        if lora is not None:
            lora.apply(gate_up, x, self.layer, ("gate_proj", "up_proj"))
        if kernels is not None:
            act = kernels.silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        down = self.down_proj(act)
        if lora is not None:
            lora.apply(down, act, self.layer, ("down_proj",))
        return down if self.reduce is None else self.reduce(down)


class DecoderLayer(nn.Module):
    def __init__(self, shape: ModelShape, layer: int):
        super().__init__()
        self.input_layernorm = nn.Parameter(torch.ones(shape.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(shape.hidden_size))
        self.self_attn = Attention(shape, layer)
        sparse = shape.moe is not None and layer in shape.moe.sparse_layers
        self.mlp = SparseMoe(shape.moe, shape.hidden_size, layer) if sparse else MLP(shape, layer)
        self.eps = shape.rms_norm_eps

    def forward(self, h, rope, batch, kv):
        h = h + self.self_attn(rms_norm(h, self.input_layernorm, self.eps), rope, batch, kv)
        return h + self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps), batch.lora)


class CausalLM(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device):
        super().__init__()
        self.shape = shape
        # weights come from the checkpoint: no random init (Embedding's, even on the meta device, imports
        # torch._dynamo: ~1 s of every engine start)
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size,
                                         _weight=torch.empty(shape.vocab_size, shape.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.lm_head = None if shape.tie_word_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope = RotaryEmbedding(shape, device)
        self.packed_head: PackedWeight | None = None
        self.gemv: "CpuKernels | None" = None  # the C GEMV for projections of few rows (`use_gemv`)
        self.head_cast: CastWeight | None = None  # the LM head in its own dtype, when it differs
        self._decode_plan: tuple[torch.Tensor, torch.dtype] | bool | None = None  # `_decode_in_one_call`, once known
        # tensor parallel (model/tensor_parallel.py): `shape` is this rank's part, `full_shape` the checkpoint's
        self.full_shape, self.tp_rank, self.tp_size = shape, 0, 1

    def set_head_dtype(self, dtype: torch.dtype) -> None:
        """Run the LM head (and so the logits) in `dtype`: fp32 for a bf16 model keeps its
        logprobs close to an fp32 forward (the known fix for trainer/inference mismatch)."""
        self.head_cast = None if dtype == self.head_weight.dtype else CastWeight(dtype)

    def packable_bytes(self) -> int:
        """Memory that `pack_weights` would take (a second copy of each weight it can pack)."""
        weights = [m.weight for m in self.modules() if isinstance(m, Projection)]
        weights += [] if self._head_reads_bf16_weight() else [self.logits_weight]
        return sum(w.numel() * w.element_size() for w in weights if PackedWeight.supported(w))

    def pack_weights(self) -> int:
        """Keep MKL-packed copies of every projection's weight (fp32 on CPU); how many were packed."""
        packed = sum(m.pack() for m in self.modules() if isinstance(m, Projection))
        self.packed_head = None if self._head_reads_bf16_weight() or not PackedWeight.supported(self.logits_weight) else PackedWeight()
        self.refresh_packed()
        return packed + (self.packed_head is not None)

    def use_gemv(self, kernels: "CpuKernels | None") -> None:
        """Run projections (the LM head too) of few rows through the kernels' GEMV (None: never)."""
        self.gemv = kernels
        for m in self.modules():
            if isinstance(m, Projection):
                m.gemv = kernels

    def refresh_packed(self) -> None:
        """Repack what changed now (after loading or updating weights), not in the next step."""
        self._decode_plan = None
        for m in self.modules():
            if isinstance(m, Projection) and m.packed is not None:
                m.packed.refresh(m.weight)
        if self.packed_head is not None:
            self.packed_head.refresh(self.logits_weight)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def logits_weight(self) -> torch.Tensor:
        """The head weight in the head's dtype (a refreshed cast copy when that differs)."""
        return self.head_weight if self.head_cast is None else self.head_cast.get(self.head_weight)

    def forward(self, input_ids, positions, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_cache is [layers, 2, slots, kv_heads, head_dim]."""
        h = self.embed_tokens(input_ids)
        rope = self.rope.tables(positions, h.dtype)
        if batch.kernels is not None:
            return self._forward_fused(h, rope, batch, kv_cache)
        for i, layer in enumerate(self.layers):
            h = layer(h, rope, batch, kv_cache[i])
        return rms_norm(h, self.norm, self.shape.rms_norm_eps)

    def _forward_fused(self, h, rope, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """The layers with the C kernels: each residual add is fused with the norm after it, the
        residual stream h updated in place, x the normed input of the next block."""
        ops, eps, layers = batch.kernels, self.shape.rms_norm_eps, self.layers
        x = torch.empty_like(h)
        if self._decode_in_one_call(h, batch, kv_cache):
            blocks = batch.decode_blocks.view(h.shape[0], -1)
            ops.decode_layers(self._decode_plan[0], self.norm, h, x, *rope, batch.slot_mapping,
                              kv_cache, blocks, batch.decode_lens, batch.block_size, self.shape, eps, layers[0].self_attn.scale)  # fmt: skip
            return x
        ops.add_rms_norm(h, None, layers[0].input_layernorm, x, eps)
        for i, layer in enumerate(layers):
            ops.add_rms_norm(h, layer.self_attn(x, rope, batch, kv_cache[i]), layer.post_attention_layernorm, x, eps)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            ops.add_rms_norm(h, layer.mlp(x, batch.lora, ops), next_norm, x, eps)
        return x

    def _decode_in_one_call(self, h: torch.Tensor, batch: AttentionBatch, kv_cache: torch.Tensor) -> bool:
        """Whether this step's layers can run as one C call (`CpuKernels.decode_layers`): decode
        only, few enough rows for the GEMV, dense layers with no LoRA and no tensor parallelism."""
        if batch.prefills or batch.lora is not None or batch.cascade is not None or self.gemv is None or not kv_cache.is_contiguous():
            return False
        if h.shape[0] > self.gemv.gemv_rows(h.dtype):
            return False
        if self._decode_plan is None:
            self._decode_plan = self._plan_decode_in_one_call()
        return self._decode_plan is not False and self._decode_plan[1] == h.dtype

    def _plan_decode_in_one_call(self) -> "tuple[torch.Tensor, torch.dtype] | bool":
        """Each layer's weight addresses in decode_impl.h's order and their dtype, or False when a
        layer is not plain attention + MLP or the weights differ in dtype. Kept until
        `refresh_packed` (weight updates copy in place, so the addresses hold; whoever replaces a
        tensor calls it, as for the packed copies)."""
        dense = all(
            isinstance(layer.mlp, MLP) and layer.mlp.reduce is None and layer.self_attn.reduce is None
            and layer.self_attn.o_proj.bias is None and layer.mlp.gate_up_proj.bias is None and layer.mlp.down_proj.bias is None
            for layer in self.layers
        )  # fmt: skip
        if not dense:
            return False
        dtypes = {w.dtype for layer in self.layers for w in (layer.self_attn.qkv_proj.weight, layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight)}  # fmt: skip
        if len(dtypes) != 1:
            return False
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        rows = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            rows.append((ptr(layer.input_layernorm), ptr(a.qkv_proj.weight), ptr(a.qkv_proj.bias), ptr(a.q_norm), ptr(a.k_norm),
                         ptr(a.o_proj.weight), ptr(layer.post_attention_layernorm), ptr(m.gate_up_proj.weight), ptr(m.down_proj.weight)))  # fmt: skip
        assert len(rows[0]) == self.gemv.decode_layer_ptrs, "decode_impl.h and the model disagree on the layer's weights"
        return torch.tensor(rows, dtype=torch.int64), dtypes.pop()

    def _head_reads_bf16_weight(self) -> bool:
        """Whether the fp32 head over a bf16 weight runs as the GEMV with fp32 sums straight from
        that weight: bf16 values widen to fp32 exactly, so this computes the fp32 head's logits (up
        to summation order) reading half the bytes of an fp32 copy, and no copy is kept. At any row
        count: its bf16 dot products beat MKL's fp32 GEMM on the copy 3-6x from 8 to 128 rows (2
        cores, AVX512_BF16), the weight's 4-output tiles staying in L1 while the rows pass."""
        if self.gemv is None or self.head_cast is None or self.head_cast.dtype != torch.float32:
            return False
        return self.head_weight.dtype == torch.bfloat16 and self.head_weight.device.type == "cpu" and self.gemv.gemv_rows(torch.bfloat16) > 0

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab]; computed in the head's dtype (`set_head_dtype`)."""
        if hidden.dtype == torch.bfloat16 and self._head_reads_bf16_weight():
            return self.gemv.gemv(hidden, self.head_weight, fp32_out=True)
        weight = self.logits_weight
        hidden = hidden.to(weight.dtype)
        if self.gemv is not None and hidden.device.type == "cpu" and hidden.shape[0] <= self.gemv.gemv_rows(weight.dtype):
            return self.gemv.gemv(hidden, weight).float()
        if self.packed_head is not None:
            return self.packed_head.linear(hidden, weight).float()
        return F.linear(hidden, weight).float()
