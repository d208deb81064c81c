"""Hugging Face checkpoint names <-> our fused parameters, and loading a model directory."""

from __future__ import annotations

import json
import math
import os
import re
import stat
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from rlserve.model import moe
from rlserve.model.llama import CausalLM
from rlserve.model.names import PROJECTIONS, dims, fused_slice
from rlserve.model.shape import ModelShape

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_PROJECTION_BY_HF = {p.hf: p for p in PROJECTIONS.values()}
_RENAMED = {
    "input_layernorm.weight": "input_layernorm",
    "post_attention_layernorm.weight": "post_attention_layernorm",
    "self_attn.q_norm.weight": "self_attn.q_norm",
    "self_attn.k_norm.weight": "self_attn.k_norm",
}


def resolve_model_dir(name: str | None) -> Path:
    """A local directory, or a hub id downloaded through huggingface_hub when the machine has a hub."""
    if name is None:
        from rlserve.model.make import default_model_dir

        return default_model_dir()
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or name.startswith("."):
        raise ValueError(f"model.name {name!r}: no such directory")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(name, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]))
    except Exception as exc:  # offline, unknown repo, gated: one clear line instead of a traceback
        raise ValueError(
            f"model.name {name!r} is not a local directory and could not be fetched from the hub ({exc}); "
            "pass a directory holding config.json and *.safetensors"
        ) from None


def check_under_roots(path: str | Path, roots: list[str]) -> Path:
    """Refuse any path that does not resolve (symlinks included) inside one of the configured roots."""
    resolved = Path(os.path.realpath(path))
    for root in roots:
        if resolved.is_relative_to(Path(os.path.realpath(root))):
            return resolved
    raise PermissionError(
        f"{str(path)!r} is outside the configured weight roots {roots}: add its parent to weight_roots"
    )


def checked_file(path: Path, roots: list[str] | None = None) -> Path:
    """`path` resolved; PermissionError outside the roots, ValueError unless it is a regular file
    (a FIFO or device would block the reader forever; a broken symlink has nothing to read)."""
    resolved = check_under_roots(path, roots) if roots is not None else path
    try:
        mode = os.stat(resolved).st_mode
    except FileNotFoundError:
        raise ValueError(f"{path} is missing (a broken symlink?)") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path} is not a regular file")
    return resolved


def read_regular(path: Path) -> bytes:
    """The whole file; opened without blocking so a FIFO swapped in after checked_file cannot hang us."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with open(fd, "rb", buffering=0) as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        return fh.read()


def safetensors_files(model_dir: Path, roots: list[str] | None = None) -> list[Path]:
    """The checkpoint's files, each a regular file under `roots` (when given) after resolving symlinks."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        index = checked_file(index, roots)
        shards = sorted(set(json.loads(read_regular(index))["weight_map"].values()))
        for shard in shards:
            if Path(shard).is_absolute() or ".." in Path(shard).parts:
                raise ValueError(f"{index} names shard {shard!r}: shards must be files inside {model_dir}")
        return [checked_file(model_dir / s, roots) for s in shards]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors files")
    return [checked_file(f, roots) for f in files]


def read_safetensors(files: Iterable[Path], device: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors backed by the files' memory maps (read lazily, page by page)."""
    for f in files:
        with safe_open(os.fspath(f), framework="pt", device=device) as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


_ST_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_safetensors_whole(files: Iterable[Path], buffer=None) -> Iterator[tuple[str, torch.Tensor]]:
    """Each file read into memory with one large read, tensors as views into it: several times
    faster than faulting in a memory map page by page. `buffer(i, nbytes)` may hand out reused
    memory for file i. Raises ValueError on a malformed file."""
    for i, f in enumerate(files):
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with open(fd, "rb", buffering=0) as fh:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{f}: not a regular file")
            size = info.st_size
            buf = buffer(i, size) if buffer is not None else torch.empty(size, dtype=torch.uint8)
            if fh.readinto(memoryview(buf.numpy())) != size:
                raise ValueError(f"{f}: short read")
        if size < 8:
            raise ValueError(f"{f}: not a safetensors file")
        header_len = int.from_bytes(buf[:8].numpy().tobytes(), "little")
        if header_len > size - 8:
            raise ValueError(f"{f}: truncated safetensors header")
        header = json.loads(buf[8 : 8 + header_len].numpy().tobytes())
        base = 8 + header_len
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            dtype, shape = _ST_DTYPES.get(meta["dtype"]), meta["shape"]
            if dtype is None:
                raise ValueError(f"{f}: {name} has unsupported dtype {meta['dtype']}")
            if base + end > size or end - start != math.prod(shape) * dtype.itemsize:
                raise ValueError(f"{f}: {name} lies outside the file (truncated?)")
            raw = buf[base + start : base + end]
            if (base + start) % dtype.itemsize:
                raw = raw.clone()  # unaligned: views need offsets divisible by the item size
            yield name, raw.view(dtype).view(shape)


def checkpoint_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """Every tensor a full HF checkpoint of this model holds, with its shape."""
    h, hd = shape.hidden_size, shape.head_dim
    sizes = dims(shape)
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape.vocab_size, h), "model.norm.weight": (h,)}
    if not shape.tie_word_embeddings:
        out["lm_head.weight"] = (shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        sparse = shape.moe is not None and i in shape.moe.sparse_layers
        out |= {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}
        for proj in PROJECTIONS.values():
            if not (sparse and proj.block == "mlp"):
                features_in, features_out = sizes[proj.name]
                out[f"{p}{proj.hf}.weight"] = (features_out, features_in)
        if sparse:
            out |= moe.checkpoint_shapes(shape.moe, h, i)
        if shape.qkv_bias:
            out |= {f"{p}self_attn.{n}.bias": (sizes[n][1],) for n in ("q_proj", "k_proj", "v_proj")}
        if shape.qk_norm:
            out |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    return out


def pushable_shapes(shape: ModelShape) -> dict[str, tuple[int, ...]]:
    """checkpoint_shapes plus the stacked expert tensors a transformers 5 trainer may push instead."""
    out = checkpoint_shapes(shape)
    for layer in shape.moe.sparse_layers if shape.moe is not None else ():
        out |= moe.stacked_shapes(shape.moe, shape.hidden_size, layer)
    return out


def target_of(model: CausalLM, params: dict[str, torch.Tensor], hf_name: str) -> torch.Tensor:
    """The slice of our parameter that holds the HF tensor `hf_name` (a view: copy_ into it to load).

    `params` is dict(model.named_parameters()), built once by the caller.
    """
    if hf_name == "model.embed_tokens.weight":
        return params["embed_tokens.weight"]
    if hf_name == "model.norm.weight":
        return params["norm"]
    if hf_name == "lm_head.weight" and model.lm_head is not None:
        return params["lm_head.weight"]
    m = _LAYER.match(hf_name)
    if m is None:
        raise KeyError(hf_name)
    layer, suffix = m.group(1), m.group(2)
    if model.shape.moe is not None and int(layer) in model.shape.moe.sparse_layers and suffix.startswith("mlp."):
        target = moe.target_of(params, model.shape.moe, layer, suffix)
        if target is None:
            raise KeyError(hf_name)
        return target
    module, kind = suffix.rsplit(".", 1)
    projection = _PROJECTION_BY_HF.get(module)
    if projection is not None:
        fused = params.get(f"layers.{layer}.{projection.ours}.{kind}")
        if fused is None:
            raise KeyError(hf_name)
        start, size = fused_slice(model.shape, projection.name)
        return fused.narrow(0, start, size)
    if suffix in _RENAMED:
        return params[f"layers.{layer}.{_RENAMED[suffix]}"]
    raise KeyError(hf_name)


def ignorable(name: str, shape: ModelShape) -> bool:
    # tied checkpoints sometimes still carry lm_head; rotary caches are derived, not loaded
    return (name == "lm_head.weight" and shape.tie_word_embeddings) or name.endswith("rotary_emb.inv_freq")


@torch.no_grad()
def load_model(
    model_dir: Path,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    tp_rank: int = 0,
    tp_size: int = 1,
    expert_parallel: tuple[int, int, int] | None = None,
) -> CausalLM:
    """The model, or under tensor parallelism (`tp_size` > 1) rank `tp_rank`'s part of it; with
    `expert_parallel` = (ep rank, ep size, redundant experts) its sparse layers hold whole experts."""
    from rlserve.model.expert_parallel import convert
    from rlserve.model.tensor_parallel import local_shape

    with torch.device("meta"):
        model = CausalLM(local_shape(shape, tp_size, experts_whole=expert_parallel is not None), device)
        if expert_parallel is not None:
            convert(model, *expert_parallel)
    rope = model.rope
    model.rope = None
    model = _allocate(model, device).to(dtype)
    model.rope = rope.to(device)  # fp32 tables, computed rather than loaded
    model.full_shape, model.tp_rank, model.tp_size = shape, tp_rank, tp_size
    model.expert_parallel = expert_parallel is not None
    expected = checkpoint_shapes(shape)
    params = dict(model.named_parameters())
    seen: set[str] = set()
    for name, tensor in read_safetensors(safetensors_files(model_dir)):
        if ignorable(name, shape):
            continue
        if name not in expected:
            raise ValueError(f"{model_dir}: unexpected tensor {name!r}")
        if tuple(tensor.shape) != expected[name]:
            raise ValueError(f"{model_dir}: {name} has shape {tuple(tensor.shape)}, expected {expected[name]}")
        copy_tensor(model, params, name, tensor)
        seen.add(name)
    missing = sorted(set(expected) - seen)
    if missing:
        raise ValueError(f"{model_dir}: missing tensors, e.g. {missing[:3]}")
    return model.eval()


def _allocate(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """`model.to_empty(device)`: uninitialized storage for every meta parameter and buffer, a shared one once.
    By hand because to_empty's first call in a process takes ~0.35 s of torch's lazy setup for meta tensors,
    paid by every engine start."""
    made: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id -> (meta tensor, kept alive so ids stay its own)

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            new = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = t, torch.nn.Parameter(new, t.requires_grad) if isinstance(t, torch.nn.Parameter) else new
        return made[id(t)][1]

    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for name, t in tensors.items():
                if t is not None:
                    tensors[name] = empty(t)
    return model


def copy_tensor(
    model: CausalLM, params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, sharded: bool = False
) -> None:
    """Copy the full HF tensor `name` (or this rank's slice of it, when `sharded`) into the model: this
    rank's slice of it, or under expert parallelism into each local slot holding that expert."""
    from rlserve.model.expert_parallel import load_expert_tensor
    from rlserve.model.tensor_parallel import shard

    if model.expert_parallel:
        m = _LAYER.match(name)
        if m is not None and load_expert_tensor(model, int(m.group(1)), m.group(2), tensor):
            return
    part = tensor if sharded else shard(name, tensor, model.tp_rank, model.tp_size, model.expert_parallel)
    target_of(model, params, name).copy_(part)


def eos_token_ids(model_dir: Path, hf_config, tokenizer) -> frozenset[int]:
    """Every id that ends a sequence: generation_config.json's, config.json's and the tokenizer's."""
    ids = set()
    gen_cfg = model_dir / "generation_config.json"
    if gen_cfg.exists():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    eos = getattr(hf_config, "eos_token_id", None)
    ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
