"""rlserve's own decoder (`model/llama.py`) run over a transformers model's parameters, exactly as the
engine runs it in batch-invariant mode.

The mirror is a `CausalLM` in the transformers model's dtype whose tensors are refreshed from the
transformers parameters (by the same HF-name mapping the engine's loader and weight pushes use) whenever
one of them changed. A forward lays every token out as its own decode row over a paged KV cache of
the engine's block size, with the invariant kernels, so each logit row has the bits the engine
computes for that token in any step, under any batch, chunking or prefix-cache hit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from rlserve.model.batch import AttentionBatch
from rlserve.model.invariant_ops import InvariantKernels
from rlserve.model.llama import CausalLM
from rlserve.model.loader import ignorable, target_of
from rlserve.model.moe import routed_experts
from rlserve.model.shape import ModelShape

if TYPE_CHECKING:
    from rlserve.model.triton_kernels import TritonKernels


class ExactMirror:
    """rlserve's CausalLM bound to a transformers model's parameters (kept in sync by `sync`)."""

    def __init__(
        self,
        hf_model: nn.Module,
        shape: ModelShape,
        dtype: torch.dtype,
        head_dtype: torch.dtype,
        kernels: InvariantKernels | TritonKernels,
        block_size: int,
    ):
        self.shape, self.dtype, self.kernels, self.block_size = shape, dtype, kernels, block_size
        self.device = device = next(hf_model.parameters()).device  # one device (`patch` checked)
        with torch.device("meta"):
            model = CausalLM(shape, torch.device("cpu"))
        rope, model.rope = model.rope, None
        model = model.to_empty(device=device).to(dtype)
        model.rope = rope.to(device)  # fp32 tables computed on CPU from the shape, as the engine's loader keeps them
        model.set_head_dtype(head_dtype)
        model.use_gemv(kernels)
        self.model = model.eval().requires_grad_(False)
        params = dict(model.named_parameters())
        # (transformers parameter, the view of ours that holds it, the (address, version) last copied)
        self.bindings: list[list] = []
        for name, param in hf_model.named_parameters():
            if ignorable(name, shape):
                continue
            target = target_of(model, params, name)  # KeyError: a tensor rlserve's model has no place for
            if tuple(target.shape) != tuple(param.shape):
                raise KeyError(f"{name}: shape {tuple(param.shape)}, rlserve's model holds {tuple(target.shape)}")
            self.bindings.append([param, target, None])
        filled = sum(t.numel() for _, t, _ in self.bindings)
        if filled != sum(p.numel() for p in params.values()):
            raise KeyError("the transformers model leaves some of rlserve's parameters unset (a missing tensor)")

    @torch.no_grad()
    def sync(self) -> None:
        """Copy in every transformers parameter changed since the last call (an optimizer step
        changes them in place, which bumps their version)."""
        changed = False
        for binding in self.bindings:
            param, target, seen = binding
            key = (param.data_ptr(), param._version)
            if key != seen:
                target.copy_(param.detach())
                binding[2] = key
                changed = True
        if changed:
            self.model.refresh_packed()

    @torch.no_grad()  # not inference mode: the logits become the output of the patch's autograd function
    def logits(self, sequences: list[list[int]], want_experts: bool = False, rows: torch.Tensor | None = None):
        """fp32 logits [total tokens, vocab] of the sequences' tokens, concatenated in order, or of
        only the tokens at `rows` of that order (each row's bits are the same either way: the head's
        GEMV computes a row alone); with `want_experts`, also the routed experts [total tokens,
        sparse layers, top_k]."""
        self.sync()
        bs = self.block_size
        ids, positions, slots, blocks, lens = [], [], [], [], []
        width = max(-(-len(s) // bs) for s in sequences)
        next_block = 0
        for seq in sequences:
            count = -(-len(seq) // bs)
            table = list(range(next_block, next_block + count))
            next_block += count
            padded = table + [0] * (width - count)  # padding is past the row's length: never read
            for p, token in enumerate(seq):
                ids.append(token)
                positions.append(p)
                slots.append(table[p // bs] * bs + p % bs)
                blocks.extend(padded)
                lens.append(p + 1)
        s, device = self.shape, self.device
        kv = torch.zeros(s.num_layers, 2, next_block * bs, s.num_kv_heads, s.head_dim, dtype=self.dtype, device=device)
        attn = AttentionBatch(
            slot_mapping=torch.tensor(slots, device=device),
            num_decode=len(ids),
            decode_blocks=torch.tensor(blocks, device=device),
            decode_mask=None,
            decode_lens=torch.tensor(lens, device=device),
            cascade=None,
            prefills=[],
            block_size=bs,
            lora=None,
            kernels=self.kernels,
        )
        hidden = self.model(torch.tensor(ids, device=device), torch.tensor(positions, device=device), attn, kv)
        logits = self.model.compute_logits(hidden if rows is None else hidden.index_select(0, rows.to(device)))
        if not want_experts:
            return logits
        return logits, routed_experts(self.model.layers, len(ids))
