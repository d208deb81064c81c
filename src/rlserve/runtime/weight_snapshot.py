"""Writing the weights an engine serves now as a checkpoint directory that a weight update from disk can load
again: a deployment keeps such a copy after a trainer's push (deploy/snapshot.py), so that a restarted
replica gets the pushed weights and a push that failed on one replica can be taken back on the others.

The tensors are copied between two engine steps (no commit can land in the middle), then written off the
engine loop: `model.safetensors` in the checkpoint's names and the model's dtype, so loading it back gives
the same bits. Under tensor parallelism each tensor is put together from every rank's slice (the leader's
`gather`). Registered into runtime/core.py's OPS as `save_weights`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlserve.engine.tp.leader import TensorParallelLeader
from rlserve.model.llama import CausalLM
from rlserve.model.loader import checkpoint_shapes, target_of
from rlserve.model.release import weights_unready

CHECKPOINT_FILE = "model.safetensors"


@torch.no_grad()
def checkpoint_tensors(
    model: CausalLM, tp: TensorParallelLeader | None = None, call_id: int = 0
) -> dict[str, torch.Tensor]:
    """Every tensor of the model's HF checkpoint as the model holds it now (copies, on the CPU); under tensor
    parallelism put together from every rank's slice (`tp`, the engine's leader; `call_id` names the work)."""
    if model.expert_parallel:
        raise RuntimeError(
            "this engine holds a part of the experts (expert parallelism): it cannot write the whole checkpoint"
        )
    if model.tp_size > 1 and tp is None:
        raise RuntimeError("this engine holds a part of each weight (tensor parallelism) and cannot reach the others")
    unready = weights_unready(model)
    if unready is not None:
        raise RuntimeError(unready)
    if model.tp_size > 1:
        return tp.gather(call_id, model)
    params = dict(model.named_parameters())
    return {name: target_of(model, params, name).to("cpu", copy=True) for name in checkpoint_shapes(model.full_shape)}


def write_checkpoint(tensors: dict[str, torch.Tensor], out_dir: str) -> None:
    """`out_dir` is created here and must not exist yet (the caller renames it into place when complete)."""
    path = Path(out_dir)
    path.mkdir(mode=0o700)
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / CHECKPOINT_FILE))
    with open(path / CHECKPOINT_FILE, "rb") as f:  # on disk before the rename makes it the deployment's copy
        os.fsync(f.fileno())


def op_save_weights(core: Any, call_id: int, out_dir: str) -> object:
    """Copy the weights now (between steps), write them off the loop; reply the versions they carry."""
    engine = core.engine
    tensors = checkpoint_tensors(engine.model, engine.tp, call_id)
    versions = [engine.policy_version, engine.weight_version]
    return core.off_loop(call_id, lambda: write_checkpoint(tensors, out_dir), lambda _: versions)


OPS = {"save_weights": op_save_weights}
