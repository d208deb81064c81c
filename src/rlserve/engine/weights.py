"""Weight updates: validate everything first, then swap at a step boundary, then bump the version.

Reading a checkpoint happens off the engine thread; only `commit` (a memcpy into the live
parameters, a repack of their CPU packed copies, the version bump) runs between two engine steps, so no forward pass mixes weights.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlserve.model.llama import CausalLM
from rlserve.model.loader import (  # noqa: F401  (check_under_roots: re-exported for callers)
    check_under_roots,
    checkpoint_shapes,
    copy_tensor,
    ignorable,
    pushable_shapes,
    read_safetensors_whole,
    safetensors_files,
    target_of,
)
from rlserve.model.release import check_writable, note_written


class WeightUpdateError(ValueError):
    """The checkpoint does not fit the served model; nothing was changed."""


@dataclass(slots=True)
class StagedWeights:
    """Validated tensors, ready to be copied into the model."""

    tensors: dict[str, torch.Tensor]
    source: str
    sharded: bool = False  # already this tensor-parallel rank's slices (a push scattered by rank 0)


class StagingBuffers:
    """Byte buffers reused from one update to the next: fresh memory costs a page fault per 4 KiB,
    as much as the copy itself. Callers serialise updates (one staged update at a time)."""

    def __init__(self) -> None:
        self._buffers: dict[int, torch.Tensor] = {}

    def __call__(self, index: int, nbytes: int, device: str = "cpu") -> torch.Tensor:
        buf = self._buffers.get(index)
        if buf is None or buf.numel() < nbytes or buf.device.type != torch.device(device).type:
            buf = self._buffers[index] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf[:nbytes]


def stage_from_dir(
    model: CausalLM, weight_dir: Path, buffers: StagingBuffers | None = None, roots: list[str] | None = None
) -> StagedWeights:
    """Every file read resolves under `roots` (PermissionError otherwise) and is a regular file."""
    if not weight_dir.is_dir():
        raise FileNotFoundError(f"weight_dir {str(weight_dir)!r} does not exist")
    try:
        files = safetensors_files(weight_dir, roots)
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightUpdateError(str(exc)) from None
    try:
        tensors = dict(read_safetensors_whole(files, buffers))
    except Exception as exc:  # a truncated or corrupt file: report it, keep serving
        raise WeightUpdateError(f"cannot read the safetensors files in {weight_dir}: {exc}") from None
    return stage(model, tensors.items(), str(weight_dir), require_all=True)


def stage(
    model: CausalLM, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str, require_all: bool
) -> StagedWeights:
    expected = pushable_shapes(model.full_shape)
    staged: dict[str, torch.Tensor] = {}
    for name, tensor in named_tensors:
        if ignorable(name, model.full_shape):
            continue
        if name not in expected:
            raise WeightUpdateError(f"{source}: tensor {name!r} does not belong to this model")
        if tuple(tensor.shape) != expected[name]:
            raise WeightUpdateError(
                f"{source}: {name} has shape {list(tensor.shape)}, the served model needs {list(expected[name])}"
            )
        if not tensor.is_floating_point():
            raise WeightUpdateError(f"{source}: {name} has dtype {tensor.dtype}; weights must be floating point")
        if not torch.isfinite(tensor.sum()):  # NaN and inf survive a sum; one read, no mask tensor
            raise WeightUpdateError(f"{source}: {name} contains NaN or infinite values")
        staged[name] = tensor
    if require_all:
        missing = sorted(set(checkpoint_shapes(model.full_shape)) - set(staged))
        if missing:
            raise WeightUpdateError(f"{source}: {len(missing)} tensors are missing, e.g. {missing[:3]}")
    if not staged:
        raise WeightUpdateError(f"{source}: no tensors to load")
    return StagedWeights(staged, source)


@torch.no_grad()
def commit(model: CausalLM, staged: StagedWeights) -> None:
    check_writable(model)
    params = dict(model.named_parameters())
    for name, tensor in staged.tensors.items():
        copy_tensor(model, params, name, tensor, staged.sharded)
    note_written(model, staged.tensors)
    model.refresh_packed()


def void_update(why: str, policy_version: int, weight_version: str) -> str:
    """The refusal of a finish whose update lost a part (a receive failed or was refused after others
    were staged): committing the rest would serve a mix of two policies under one label."""
    return (
        f"this weight update lost a part ({why}), so nothing of it was committed: the previous weights keep "
        f"serving at policy_version {policy_version} ({weight_version!r}); start the update again"
    )
