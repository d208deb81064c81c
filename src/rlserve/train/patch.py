"""`patch(model)`: a transformers causal LM whose forward returns the logits rlserve's batch-invariant
mode computes, bit for bit, while autograd and parameter names stay as they were.

The forward's values come from rlserve's own decoder over the model's parameters (`mirror.py`);
its gradient is autograd's through the model's original forward, recomputed in the backward pass
(as activation checkpointing does): the same function in exact arithmetic, so the gradient is the
usual one, and the numbers the loss sees are the sampler's. Settings under which the bits could
differ are refused (`PatchRefused`), never served approximately.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from rlserve.config.schema import Config
from rlserve.model.invariant_ops import BatchInvarianceUnavailable, invariant_kernels
from rlserve.model.shape import ModelShape
from rlserve.train.mirror import ExactMirror

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral")
DTYPES = (torch.float32, torch.bfloat16)


class PatchRefused(BatchInvarianceUnavailable):
    """The model or setting cannot reproduce rlserve's batch-invariant numerics; the message says why."""


def patch(
    model: nn.Module,
    *,
    block_size: int | None = None,
    lm_head_dtype: str = "auto",
) -> nn.Module:
    """Make `model` (a transformers Llama/SmolLM, Qwen2, Qwen3, Qwen3-MoE or Mistral causal LM, on CPU or
    one CUDA device, all in float32 or all in bfloat16) compute rlserve's batch-invariant numerics;
    returns it, changed in place.

    `block_size` and `lm_head_dtype` must be the serving engine's (`engine.block_size`: attention
    walks the context in blocks of that size; `model.lm_head_dtype`); their defaults are rlserve's.
    Raises PatchRefused where the bits could not match."""
    if getattr(model, "_rlserve_exact", None) is not None:
        return model
    cfg = getattr(model, "config", None)
    model_type = getattr(cfg, "model_type", None)
    if model_type not in FAMILIES:
        raise PatchRefused(
            f"rlserve.train.patch: model_type {model_type!r} is not a family rlserve serves exactly "
            f"({', '.join(FAMILIES)})"
        )
    _check_config(cfg, model_type)
    params = list(model.parameters())
    devices = {p.device for p in params}
    device = next(iter(devices))
    if len(devices) != 1 or device.type not in ("cpu", "cuda"):
        raise PatchRefused(
            f"rlserve.train.patch: the model is on {sorted(map(str, devices))}; the exact numerics exist on CPU "
            "and on one CUDA device (rlserve's batch-invariant mode runs there): move the whole model to one of them"
        )
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1 or next(iter(dtypes)) not in DTYPES:
        raise PatchRefused(
            f"rlserve.train.patch: the parameters are {sorted(map(str, dtypes))}; they must all be float32 "
            "or all bfloat16 (the engine's model.dtype)"
        )
    if any(type(p.data) is not torch.Tensor for p in params):
        raise PatchRefused(
            "rlserve.train.patch: sharded parameters (DTensor: tensor or fully-sharded parallelism) "
            "reduce across ranks in another order than one process; gather the model onto one process"
        )
    dtype = next(iter(dtypes))
    try:
        shape = ModelShape.from_hf(cfg)
    except ValueError as exc:
        raise PatchRefused(f"rlserve.train.patch: {exc}") from None
    block_size = block_size or Config().engine.block_size
    kernels = invariant_kernels(device.type, dtype)
    if not kernels.supports(shape.num_heads, shape.num_kv_heads, shape.head_dim, block_size, dtype):
        raise PatchRefused(
            f"rlserve.train.patch: rlserve's {device.type} kernels do not cover this model's attention in {dtype} "
            f"(heads {shape.num_heads}/{shape.num_kv_heads}, head_dim {shape.head_dim}, block_size {block_size})"
        )
    head_dtype = torch.float32 if lm_head_dtype == "auto" else getattr(torch, lm_head_dtype, None)
    if head_dtype not in (torch.float32, dtype):
        raise PatchRefused(f"rlserve.train.patch: lm_head_dtype={lm_head_dtype} must be auto, float32 or {dtype}")
    try:
        mirror = ExactMirror(model, shape, dtype, head_dtype, kernels, block_size)
    except KeyError as exc:
        raise PatchRefused(f"rlserve.train.patch: rlserve's model has no place for a tensor: {exc}") from None
    model._rlserve_exact = mirror
    model._rlserve_reference_forward = model.forward
    model.forward = types.MethodType(exact_forward, model)
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Give `model` its own forward back (for comparisons); returns it."""
    if getattr(model, "_rlserve_exact", None) is not None:
        model.forward = model._rlserve_reference_forward
        del model._rlserve_exact, model._rlserve_reference_forward
    return model


def _check_config(cfg, model_type: str) -> None:
    """Settings transformers honours that rlserve's decoder does not compute."""
    reasons = []
    if model_type == "llama" and getattr(cfg, "mlp_bias", False):
        reasons.append("mlp_bias=true")
    if model_type == "llama" and getattr(cfg, "attention_bias", False):
        reasons.append("attention_bias=true (an o_proj bias)")
    if getattr(cfg, "use_sliding_window", False) or (model_type == "mistral" and getattr(cfg, "sliding_window", None)):
        reasons.append("sliding-window attention")
    if getattr(cfg, "attention_dropout", 0.0):
        reasons.append(f"attention_dropout={cfg.attention_dropout} (the sampler has none)")
    if getattr(cfg, "hidden_act", "silu") != "silu":
        reasons.append(f"hidden_act={cfg.hidden_act}")
    if reasons:
        raise PatchRefused(f"rlserve.train.patch: rlserve's decoder does not compute {', '.join(reasons)}")


def segments(attention_mask: torch.Tensor, position_ids: torch.Tensor | None) -> list[tuple[int, list[int]]]:
    """(row, column indices) of each sequence in a batch: a row's unmasked tokens in order, split
    where position_ids restarts at 0 (packed rows)."""
    out = []
    for row in range(attention_mask.shape[0]):
        cols = attention_mask[row].nonzero().flatten().tolist()
        current: list[int] = []
        for col in cols:
            if current and position_ids is not None and int(position_ids[row, col]) == 0:
                out.append((row, current))
                current = []
            current.append(col)
        if current:
            out.append((row, current))
    return out


class _ExactLogits(torch.autograd.Function):
    """Values from rlserve's decoder; gradient through the model's own forward, recomputed (the LM head
    only over the rows that have a gradient)."""

    @staticmethod
    def forward(ctx, model, input_ids, layout, wanted, *params):
        ctx.model, ctx.input_ids, ctx.layout, ctx.wanted, ctx.params = model, input_ids, layout, wanted, params
        return exact_logits(model, input_ids, layout, wanted)

    @staticmethod
    def backward(ctx, grad):
        with torch.enable_grad():
            ref, grad = reference_logits(ctx.model, ctx.input_ids, ctx.layout, ctx.wanted, grad)
        grads = torch.autograd.grad(ref, ctx.params, grad, allow_unused=True)
        return (None, None, None, None, *grads)


def logits_of(model, input_ids: torch.Tensor, layout, wanted: list[list[int]] | None = None) -> torch.Tensor:
    """A patched model's fp32 logits, differentiable: [batch, length, vocab] with zeros at padding, or,
    given `wanted` (for each sequence of `layout`, the positions in it whose logits are needed), only
    those rows, concatenated in order: the head then runs on those rows alone, forward and backward."""
    params = [p for p in model.parameters() if p.requires_grad]
    if torch.is_grad_enabled() and params:
        return _ExactLogits.apply(model, input_ids, layout, wanted, *params)
    return exact_logits(model, input_ids, layout, wanted)


def exact_logits(model, input_ids: torch.Tensor, layout, wanted: list[list[int]] | None) -> torch.Tensor:
    seqs = [input_ids[row, cols].tolist() for row, cols in layout]
    if wanted is not None:
        return model._rlserve_exact.logits(seqs, rows=_flat_rows(seqs, wanted))
    b, length = input_ids.shape
    flat = model._rlserve_exact.logits(seqs)
    out = flat.new_zeros(b, length, flat.shape[1])
    start = 0
    for row, cols in layout:
        out[row, cols] = flat[start : start + len(cols)]
        start += len(cols)
    return out


def _flat_rows(seqs: list[list[int]], wanted: list[list[int]]) -> torch.Tensor:
    """The indices of the wanted positions among all the sequences' tokens, concatenated."""
    rows, start = [], 0
    for seq, positions in zip(seqs, wanted, strict=True):
        rows.extend(start + p for p in positions)
        start += len(seq)
    return torch.tensor(rows, dtype=torch.long)


def reference_logits(model, input_ids: torch.Tensor, layout, wanted, grad: torch.Tensor):
    """The model's own forward over the same sequences, as (fp32 logits, their gradient) restricted to
    the rows whose gradient is not zero: only those go through the LM head (a loss over completion
    tokens leaves the prompt's rows at zero), which gives the same parameter gradient in less time."""
    hidden, where = _reference_hidden(model, input_ids, layout)
    if wanted is not None:
        rows = _flat_rows([cols for _, cols in layout], wanted)
    else:
        flat = grad[where[:, 0], where[:, 1]]
        rows = flat.ne(0).any(-1).nonzero().flatten()
        grad = flat.index_select(0, rows)
    logits = model.get_output_embeddings()(hidden.index_select(0, rows.to(hidden.device))).float()
    return logits, grad


def _reference_hidden(model, input_ids: torch.Tensor, layout) -> tuple[torch.Tensor, torch.Tensor]:
    """The transformers decoder's final hidden states of every sequence's tokens, concatenated in
    layout order, with their (row, column) places in input_ids."""
    b, length = input_ids.shape
    decoder = model.get_decoder()
    device = input_ids.device
    where = torch.tensor([(row, col) for row, cols in layout for col in cols], dtype=torch.long, device=device)
    if len({row for row, _ in layout}) == len(layout):  # one sequence a row: one padded call
        mask = torch.zeros(b, length, dtype=torch.long, device=device)
        pos = torch.zeros(b, length, dtype=torch.long, device=device)
        for row, cols in layout:
            mask[row, cols] = 1
            pos[row, cols] = torch.arange(len(cols), device=device)
        hidden = decoder(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        return hidden[where[:, 0], where[:, 1]], where
    parts = [  # packed rows: each sequence alone
        decoder(input_ids=input_ids[row, cols].unsqueeze(0), use_cache=False).last_hidden_state[0]
        for row, cols in layout
    ]
    return torch.cat(parts), where


def exact_forward(self, input_ids=None, attention_mask=None, position_ids=None, **kwargs):
    """The patched forward: transformers' output type with fp32 logits of rlserve's numerics
    (zeros at padded positions). No KV cache, no loss: compute the loss from the logits."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    unsupported = [k for k in ("inputs_embeds", "past_key_values", "labels") if kwargs.get(k) is not None]
    if input_ids is None or unsupported:
        raise ValueError(
            "the rlserve-patched forward takes input_ids (with attention_mask / position_ids); it does not take "
            f"{', '.join(unsupported) or 'inputs_embeds'}: compute the loss from the returned logits"
        )
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    logits = logits_of(self, input_ids, segments(attention_mask, position_ids))
    keep = kwargs.get("logits_to_keep", 0)
    if isinstance(keep, int) and keep:
        logits = logits[:, -keep:]
    return CausalLMOutputWithPast(logits=logits)
