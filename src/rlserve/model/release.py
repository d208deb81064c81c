"""Releasing the model's weights' memory and getting it back (vLLM's sleep level 2 on CPU).

`release_weights` gives every parameter empty storage and drops what is derived from the weights (the
packed GEMM copies, the cast LM head, the C kernels' table of weight addresses), so the allocator can
return all of it to the OS. `allocate_weights` gives the parameters memory again, its contents
undefined: the model then awaits every checkpoint tensor (`awaiting_weights`), and `note_written`
crosses off what a weight update wrote. Until nothing is awaited the model must not run.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from rlserve.model.linear import Projection
from rlserve.model.llama import CausalLM
from rlserve.model.loader import checkpoint_shapes

# transformers 5's stacked experts tensor -> the per-expert checkpoint tensors it holds
_STACKED = re.compile(r"(model\.layers\.\d+\.mlp\.experts\.)(gate_up_proj|down_proj)$")
_STACKED_PARTS = {"gate_up_proj": ("gate_proj.weight", "up_proj.weight"), "down_proj": ("down_proj.weight",)}


def weights_unready(model: CausalLM) -> str | None:
    """Why the model cannot run now (its weights released or not all written since), or None."""
    if model.released_weights is not None:
        return (
            "the weights were released by /sleep level 2: POST /wake_up, then restore them with a weight "
            'update or POST /collective_rpc {"method": "reload_weights"}'
        )
    if model.awaiting_weights:
        missing = sorted(model.awaiting_weights)
        return (
            f"the weights released by /sleep level 2 are not restored yet ({len(missing)} tensors missing, "
            f"e.g. {missing[0]}): push them with a weight update or POST /collective_rpc "
            '{"method": "reload_weights"}'
        )
    return None


@torch.no_grad()
def release_weights(model: CausalLM) -> int:
    """Free every parameter's memory and the copies derived from it; returns the parameter bytes freed."""
    if model.released_weights is not None:
        return 0
    released, freed = [], 0
    for param in model.parameters():  # each shared (tied) parameter once
        released.append((param, tuple(param.shape)))
        freed += param.numel() * param.element_size()
        param.set_(torch.empty(0, dtype=param.dtype, device=param.device))
    _drop_derived(model)
    model.released_weights, model.awaiting_weights = released, None
    return freed


@torch.no_grad()
def allocate_weights(model: CausalLM) -> None:
    """Give the parameters memory again (contents undefined: pages are touched only when written)."""
    if model.released_weights is None:
        return
    for param, shape in model.released_weights:
        param.set_(torch.empty(shape, dtype=param.dtype, device=param.device))
    model.released_weights = None
    model.awaiting_weights = set(checkpoint_shapes(model.full_shape))
    _drop_derived(model)  # new addresses: the next refresh_packed rebuilds from what is written


def check_writable(model: CausalLM) -> None:
    """A weight update needs the parameters' memory: RuntimeError while it is released."""
    if model.released_weights is not None:
        raise RuntimeError(
            "the weights were released by /sleep level 2: POST /wake_up?tags=weights before pushing weights"
        )


def note_written(model: CausalLM, names: Iterable[str]) -> None:
    """Cross the checkpoint tensors a committed update wrote off the awaited ones."""
    awaiting = model.awaiting_weights
    if not awaiting:
        return
    for name in names:
        stacked = _STACKED.match(name)
        if stacked is None:
            awaiting.discard(name)
            continue
        prefix, suffixes = stacked.group(1), _STACKED_PARTS[stacked.group(2)]
        awaiting.difference_update([n for n in awaiting if n.startswith(prefix) and n.endswith(suffixes)])
    if not awaiting:
        model.awaiting_weights = None


def _drop_derived(model: CausalLM) -> None:
    model._decode_plan = None  # the C kernels' weight addresses
    for module in model.modules():
        if isinstance(module, Projection) and module.packed is not None:
            module.packed.forget()
        if isinstance(module, Projection) and module.panels is not None:
            module.panels.forget()
    for derived in (model.packed_head, model.panel_head):
        if derived is not None:
            derived.forget()
    if model.head_cast is not None:
        model.head_cast.forget()
