"""Writing the weights an engine serves now as a checkpoint directory that a weight update from disk can load
again: a deployment keeps such a copy after a trainer's push (deploy/snapshot.py), so that a restarted
replica gets the pushed weights and a push that failed on one replica can be taken back on the others.

The tensors are copied between two engine steps (no commit can land in the middle), then written off the
engine loop: `model.safetensors` in the checkpoint's names and the model's dtype, so loading it back gives
the same bits. Under tensor parallelism each tensor is put together from every rank's slice (the leader's
`gather`). Under expert parallelism over several engines each engine holds only its own experts, so each
writes one part (`model-0000r-of-0000N.safetensors`): the first engine every non-expert tensor, and each
engine the experts whose first replica it holds; the server then indexes the parts (`write_index`).
Registered into runtime/core.py's OPS as `save_weights`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from rlserve.engine.tp.leader import TensorParallelLeader
from rlserve.model.expert_parallel import engine_part, placement_key, primary_experts, shared_names, slot_names
from rlserve.model.llama import CausalLM
from rlserve.model.loader import checkpoint_shapes, target_of
from rlserve.model.release import weights_unready
from rlserve.model.shape import ModelShape

CHECKPOINT_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@torch.no_grad()
def checkpoint_tensors(
    model: CausalLM, tp: TensorParallelLeader | None = None, call_id: int = 0
) -> dict[str, torch.Tensor]:
    """Every tensor of the model's HF checkpoint as the model holds it now (copies, on the CPU), or this
    engine's part of it under expert parallelism (`part_file`); under tensor parallelism put together from
    every rank's slice (`tp`, the engine's leader; `call_id` names the work)."""
    if model.tp_size > 1 and tp is None:
        raise RuntimeError("this engine holds a part of each weight (tensor parallelism) and cannot reach the others")
    unready = weights_unready(model)
    if unready is not None:
        raise RuntimeError(unready)
    if model.tp_size > 1:
        return tp.gather(call_id, model)
    params = dict(model.named_parameters())
    names = shared_names(model, checkpoint_shapes(model.full_shape))
    out = {name: target_of(model, params, name).to("cpu", copy=True) for name in names}
    return out | primary_experts(model, {name: [params[name]] for name in slot_names(model)})


def part_file(model: CausalLM) -> str:
    """The file this engine's tensors go to: HF's name for its shard when its expert group spans engines."""
    index, count = engine_part(model) if model.expert_parallel else (0, 1)
    return CHECKPOINT_FILE if count == 1 else f"model-{index + 1:05d}-of-{count:05d}.safetensors"


def write_checkpoint(tensors: dict[str, torch.Tensor], out_dir: str, file: str = CHECKPOINT_FILE) -> None:
    """`out_dir` exists already (the caller renames it into place when complete)."""
    path = Path(out_dir) / file
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path))
    _sync(path)


def write_index(out_dir: str, files: list[str], shape: ModelShape) -> None:
    """HF's model.safetensors.index.json over the parts in `out_dir`, once every part is written. Raises
    RuntimeError unless each tensor of the checkpoint is in exactly one part, with its shape."""
    expected, weight_map, total = checkpoint_shapes(shape), {}, 0
    for file in files:
        for name, meta in _header(Path(out_dir) / file).items():
            if name == "__metadata__":
                continue
            if name in weight_map:
                raise RuntimeError(f"{name} was written twice, in {weight_map[name]} and {file}")
            if name not in expected or tuple(meta["shape"]) != expected[name]:
                raise RuntimeError(f"{file} holds {name} of shape {meta['shape']}, not a tensor of this model")
            weight_map[name] = file
            start, end = meta["data_offsets"]
            total += end - start
    missing = sorted(set(expected) - set(weight_map))
    if missing:
        raise RuntimeError(f"no engine wrote {len(missing)} tensors, e.g. {missing[:3]}")
    path = Path(out_dir) / INDEX_FILE
    path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}))
    _sync(path)


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        return json.loads(f.read(int.from_bytes(f.read(8), "little")))


def _sync(path: Path) -> None:
    with open(path, "rb") as f:  # on disk before the rename makes it the deployment's copy
        os.fsync(f.fileno())


def op_save_weights(core: Any, call_id: int, out_dir: str) -> object:
    """Copy the weights now (between steps), write them off the loop; reply the versions they carry, the file
    written, and the expert placement they were copied under."""
    engine = core.engine
    tensors = checkpoint_tensors(engine.model, engine.tp, call_id)
    file = part_file(engine.model)
    reply = [engine.policy_version, engine.weight_version, file, placement_key(engine.model)]
    return core.off_loop(call_id, lambda: write_checkpoint(tensors, out_dir, file), lambda _: reply)


OPS = {"save_weights": op_save_weights}
