"""One Llama-family decoder (Llama, Qwen2 with qkv bias, Qwen3 with q/k norm) over a paged KV cache.

Projections are fused (one QKV matmul, one gate-up matmul): fewer, larger matmuls are the main
lever on CPU. Arithmetic order follows transformers so logprobs match its forward pass.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model.batch import AttentionBatch, CascadePlan, PrefillSeq
from rlserve.model.huge_pages import huge_page_buffer
from rlserve.model.linear import CastWeight, PackedWeight, PanelSet, PanelWeight, Projection
from rlserve.model.moe import SparseMoe
from rlserve.model.rope import RotaryEmbedding, apply_rope
from rlserve.model.shape import ModelShape
from rlserve.model.torch_threads import one_torch_thread

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels
    from rlserve.model.lora import LoraBatch


def logits_dtype(dtype: torch.dtype) -> torch.dtype:
    """Logits, log_softmax and sampling run in float32, or in float64 for a float64 (reference) run."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, weight.shape, weight, eps)


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
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = (
            None  # tensor parallel: sums the ranks' o_proj outputs
        )

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
            batch.kernels.qk_rope_store(
                qkv, cos, sin, self.q_norm, self.k_norm, self.eps, batch.slot_mapping, k_cache, v_cache, nh, nkv
            )
            q, k, v = heads[:, :nh], heads[:, nh : nh + nkv], heads[:, nh + nkv :]
        else:
            heads = qkv.reshape(t, nh + 2 * nkv, self.head_dim)
            if self.q_norm is not None:
                qk = torch.cat(
                    (
                        rms_norm(heads[:, :nh], self.q_norm, self.eps),
                        rms_norm(heads[:, nh : nh + nkv], self.k_norm, self.eps),
                    ),
                    1,
                )
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
        keys = (
            k_cache.view(-1, block).index_select(0, batch.decode_blocks).view(b, -1, self.num_kv_heads, self.head_dim)
        )
        values = (
            v_cache.view(-1, block).index_select(0, batch.decode_blocks).view(b, -1, self.num_kv_heads, self.head_dim)
        )
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
        elif q.device.type == "cpu":
            return self._prefill_after_cache(q, k, v, p, k_cache, v_cache)
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

    def _prefill_after_cache(self, q, k, v, p: PrefillSeq, k_cache, v_cache):
        """A chunk after cached context (chunked prefill, a prefix-cache hit), CPU: the chunk's
        queries attend to the cached keys (no mask) and to their own (causal, unmasked), merged by
        log-sum-exp. One SDPA with the [chunk, context] mask computes the masked half of the
        chunk's own square too and reads the mask; at a 4096-token prompt in 2048-token chunks
        the second chunk's attention took 2.5x the first's."""
        cached = p.ctx_slots[: p.ctx_len - p.q_len]
        q4 = q.transpose(0, 1).unsqueeze(0)
        keys = k_cache.index_select(0, cached).transpose(0, 1).unsqueeze(0)
        values = v_cache.index_select(0, cached).transpose(0, 1).unsqueeze(0)
        o_pre, lse_pre = _attention_with_lse(q4, keys, values, None, self.scale)
        o_own, lse_own = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q4, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), is_causal=True, scale=self.scale
        )
        # softmax over both halves = the halves weighted by sigmoid of their log-sum-exp difference
        o_own.lerp_(o_pre, (lse_pre - lse_own).sigmoid_().unsqueeze(-1).to(o_own.dtype))
        return o_own.squeeze(0).transpose(0, 1)


def _attention_with_lse(q, k, v, mask: torch.Tensor | None, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """SDPA that also returns each query's log-sum-exp of scores ([B, H, L, D] and [B, H, L])."""
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scale)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, layer: int):
        super().__init__()
        self.layer = layer
        self.gate_up_proj = Projection(shape.hidden_size, 2 * shape.intermediate_size, bias=False)
        self.down_proj = Projection(shape.intermediate_size, shape.hidden_size, bias=False)
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = (
            None  # tensor parallel: sums the ranks' down_proj outputs
        )

    def forward(self, x, lora: LoraBatch | None, kernels: CpuKernels | None = None):
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


class DecodePlan(NamedTuple):
    """What the one-call decode needs of the model, kept until `refresh_packed`."""

    layer_ptrs: torch.Tensor  # [layers, decode_layer_ptrs] int64: decode_impl.h's weight addresses
    dtype: torch.dtype  # of every projection's weight
    panels: PanelSet  # the projections' panels (none where they take the GEMV)


def _dense_projections(layer) -> tuple[Projection, Projection, Projection, Projection]:
    """A dense layer's projections in decode_impl.h's order: qkv, o, gate_up, down."""
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


class CausalLM(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device):
        super().__init__()
        self.shape = shape
        # weights come from the checkpoint: no random init (Embedding's, even on the meta device, imports
        # torch._dynamo: ~1 s of every engine start)
        self.embed_tokens = nn.Embedding(
            shape.vocab_size, shape.hidden_size, _weight=torch.empty(shape.vocab_size, shape.hidden_size)
        )
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_layers))
        self.norm = nn.Parameter(torch.ones(shape.hidden_size))
        self.lm_head = None if shape.tie_word_embeddings else nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rope = RotaryEmbedding(shape, device)
        self.packed_head: PackedWeight | None = None
        self.panel_head: PanelWeight | None = None  # the LM head's panels (`pack_panels`)
        self.gemv: CpuKernels | None = None  # the C GEMV for projections of few rows (`use_gemv`)
        self.head_cast: CastWeight | None = None  # the LM head in its own dtype, when it differs
        self._decode_plan: DecodePlan | bool | None = None  # `_decode_in_one_call`, once known
        # tensor parallel (model/tensor_parallel.py): `shape` is this rank's part, `full_shape` the checkpoint's
        self.full_shape, self.tp_rank, self.tp_size = shape, 0, 1
        self.expert_parallel = False  # sparse layers hold whole experts (model/expert_parallel.py)
        # sleep level 2 (model/release.py): the parameters whose memory is released, with their shapes,
        # then the checkpoint tensors not yet written since it was allocated again
        self.released_weights: list[tuple[nn.Parameter, tuple[int, ...]]] | None = None
        self.awaiting_weights: set[str] | None = None

    def set_head_dtype(self, dtype: torch.dtype) -> None:
        """Run the LM head (and so the logits) in `dtype`: fp32 for a bf16 model keeps its
        logprobs close to an fp32 forward (the known fix for trainer/inference mismatch)."""
        self.head_cast = None if dtype == self.head_weight.dtype else CastWeight(dtype)

    def packable_bytes(self) -> int:
        """Memory that `pack_weights` would take (a second copy of each weight it can pack)."""
        weights = [m.weight for m in self.modules() if isinstance(m, Projection)]
        weights += [] if self._head_reads_bf16_weight() else [self.logits_weight]
        return sum(PackedWeight.packed_bytes(w) for w in weights if PackedWeight.supported(w))

    def pack_weights(self) -> int:
        """Keep MKL-packed copies of every projection's weight (fp32 on CPU); how many were packed."""
        packed = sum(m.pack() for m in self.modules() if isinstance(m, Projection))
        self.packed_head = (
            None if self._head_reads_bf16_weight() or not PackedWeight.supported(self.logits_weight) else PackedWeight()
        )
        self.refresh_packed()
        return packed + (self.packed_head is not None)

    def panel_bytes(self) -> int:
        """Memory that `pack_panels` would take."""
        weights = [m.weight for m in self.modules() if isinstance(m, Projection)] + [self.head_weight]
        return sum(self.gemv.gemm_packed_bytes(w) for w in weights if w.dtype in (torch.float32, torch.bfloat16))

    def pack_panels(self) -> None:
        """Keep every projection's weight (the LM head's too) in the C GEMM's panels and run them
        through it at any row count (after `use_gemv` gave the model the kernels; in batch-invariant
        mode the same bits as unpacked). All of them in one buffer on 2 MiB pages (`huge_page_buffer`)."""
        projections = [m for m in self.modules() if isinstance(m, Projection)]
        weights = [m.weight for m in projections] + [self._panel_head_weight()]
        sizes = [self.gemv.gemm_packed_bytes(w) for w in weights]
        buffers = huge_page_buffer(sum(sizes)).split(sizes) if sum(sizes) else [None] * len(sizes)
        for m, buffer in zip(projections, buffers):
            m.panels = PanelWeight(self.gemv, buffer)
        self.panel_head = PanelWeight(self.gemv, buffers[-1])
        self.refresh_packed()

    def use_gemv(self, kernels: CpuKernels | None) -> None:
        """Run projections (the LM head too) of few rows through the kernels' GEMV (None: never)."""
        self.gemv = kernels
        for m in self.modules():
            if isinstance(m, Projection):
                m.gemv = kernels

    def refresh_packed(self) -> None:
        """Repack what changed now (after loading or updating weights), not in the next step."""
        self._decode_plan = None
        if self.released_weights is not None:  # nothing to pack until the memory is back (model/release.py)
            return
        for m in self.modules():
            if isinstance(m, Projection):
                if m.packed is not None:
                    m.packed.refresh(m.weight)
                if m.panels is not None:
                    m.panels.get(m.weight)
        if self.packed_head is not None:
            self.packed_head.refresh(self.logits_weight)
        if self.panel_head is not None:
            self.panel_head.get(self._panel_head_weight())

    @property
    def head_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @property
    def logits_weight(self) -> torch.Tensor:
        """The head weight in the head's dtype (a refreshed cast copy when that differs)."""
        return self.head_weight if self.head_cast is None else self.head_cast.get(self.head_weight)

    def forward(self, input_ids, positions, batch: AttentionBatch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; kv_cache is [layers, 2, slots, kv_heads, head_dim]."""
        with one_torch_thread():
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
            ops.decode_layers(self._decode_plan.layer_ptrs, self.norm, h, x, *rope, batch.slot_mapping,
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
        if (
            batch.prefills
            or batch.lora is not None
            or batch.cascade is not None
            or getattr(self.gemv, "decode_layers", None) is None  # no kernels, or Triton's (no one-call decode)
            or not kv_cache.is_contiguous()
        ):
            return False
        if h.shape[0] > self.gemv.gemv_rows(h.dtype) and self.panel_head is None:  # panels: any row count
            return False
        if self._decode_plan is None:
            self._decode_plan = self._plan_decode_in_one_call()
        elif self._decode_plan is not False:  # a weight updated in place: repack
            self._decode_plan.panels.refresh()
        return self._decode_plan is not False and self._decode_plan.dtype == h.dtype

    def _plan_decode_in_one_call(self) -> DecodePlan | bool:
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
        dtypes = {p.weight.dtype for layer in self.layers for p in _dense_projections(layer)}
        if len(dtypes) != 1:
            return False
        ptr = lambda t: 0 if t is None else t.data_ptr()  # noqa: E731
        panels = lambda p: 0 if p.panels is None else p.panels.get(p.weight).data_ptr()  # noqa: E731
        rows = []
        for layer in self.layers:
            a, m = layer.self_attn, layer.mlp
            rows.append((ptr(layer.input_layernorm), ptr(a.qkv_proj.weight), ptr(a.qkv_proj.bias), ptr(a.q_norm), ptr(a.k_norm),
                         ptr(a.o_proj.weight), ptr(layer.post_attention_layernorm), ptr(m.gate_up_proj.weight), ptr(m.down_proj.weight),
                         *(panels(p) for p in _dense_projections(layer))))  # fmt: skip
        assert len(rows[0]) == self.gemv.decode_layer_ptrs, (
            "decode_impl.h and the model disagree on the layer's weights"
        )
        projections = [p for layer in self.layers for p in _dense_projections(layer)]
        return DecodePlan(torch.tensor(rows, dtype=torch.int64), dtypes.pop(), PanelSet(projections))

    def _head_reads_bf16_weight(self) -> bool:
        """Whether the fp32 head over a bf16 weight runs as the GEMV with fp32 sums straight from
        that weight: bf16 values widen to fp32 exactly, so this computes the fp32 head's logits (up
        to summation order) reading half the bytes of an fp32 copy, and no copy is kept. At any row
        count: its bf16 dot products beat MKL's fp32 GEMM on the copy 3-6x from 8 to 128 rows (2
        cores, AVX512_BF16), the weight's 4-output tiles staying in L1 while the rows pass."""
        if self.gemv is None or self.head_cast is None or self.head_cast.dtype != torch.float32:
            return False
        return self.head_weight.dtype == torch.bfloat16 and self.gemv.gemv_rows(torch.bfloat16) > 0

    def _panel_head_weight(self) -> torch.Tensor:
        """The weight the head's panels hold: its bf16 weight where the head reads it, else `logits_weight`."""
        return self.head_weight if self._head_reads_bf16_weight() else self.logits_weight

    def _head_panels(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The panels of the weight the head multiplies by (its bf16 weight or the cast copy)."""
        return None if self.panel_head is None else self.panel_head.get(weight)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] (fp64 for a float64 head); computed in the head's dtype (`set_head_dtype`)."""
        if hidden.dtype == torch.bfloat16 and self._head_reads_bf16_weight():
            return self.gemv.gemv(hidden, self.head_weight, fp32_out=True, packed=self._head_panels(self.head_weight))
        weight = self.logits_weight
        hidden, out = hidden.to(weight.dtype), logits_dtype(weight.dtype)
        if self.gemv is not None and (
            hidden.shape[0] <= self.gemv.gemv_rows(weight.dtype) or self.panel_head is not None
        ):
            return self.gemv.gemv(hidden, weight, packed=self._head_panels(weight)).to(out)
        if self.packed_head is not None:
            return self.packed_head.linear(hidden, weight).to(out)
        return F.linear(hidden, weight).to(out)
