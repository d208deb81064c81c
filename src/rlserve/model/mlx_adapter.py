"""mlx-lm LoRA adapters (`mlx_lm.lora`'s adapters.safetensors + adapter_config.json) as PEFT adapters.

mlx-lm stores lora_a [in, r] and lora_b [r, out] and applies y = W x + scale * (x A) B; PEFT stores
lora_A [r, in] and lora_B [out, r] with scaling lora_alpha / r. So A and B are transposed and
lora_alpha = scale * r. What plain LoRA cannot honour (DoRA, full fine-tunes, quantized adapters, modules
the model lacks) is refused with the field named, never served as something else.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors.torch import load, save_file

from rlserve.model.lora_targets import AdapterError
from rlserve.model.names import PROJECTIONS
from rlserve.model.shape import ModelShape

_NAME = re.compile(r"^(?:language_model\.)?(?:model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([ab])$")


def is_mlx_config(cfg: object) -> bool:
    return isinstance(cfg, dict) and ("lora_parameters" in cfg or "fine_tune_type" in cfg) and "r" not in cfg


def mlx_to_peft(
    cfg: dict, tensors: dict[str, torch.Tensor], shape: ModelShape, where: str
) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT adapter_config, PEFT tensors) of an mlx-lm adapter; AdapterError naming what cannot be honoured."""
    kind = cfg.get("fine_tune_type", "lora")
    if kind != "lora":
        raise AdapterError(
            f"{where}: fine_tune_type {kind!r} is not supported; rlserve serves plain LoRA adapters "
            '(fine_tune_type "lora") only'
        )
    if cfg.get("quantization") or cfg.get("quantize"):
        raise AdapterError(f"{where}: quantization: quantized adapters are not supported; save it unquantized")
    params = cfg.get("lora_parameters")
    if not isinstance(params, dict):
        raise AdapterError(f"{where}: lora_parameters must be an object with rank and scale")
    try:
        rank, scale = int(params["rank"]), float(params.get("scale", 20.0))
    except (KeyError, TypeError, ValueError) as exc:
        raise AdapterError(f"{where}: lora_parameters.rank and lora_parameters.scale must be numbers ({exc})") from None
    if rank < 1 or not math.isfinite(scale):
        raise AdapterError(f"{where}: lora_parameters.rank must be >= 1 and scale finite, got {rank}, {scale}")
    for key in params.get("keys") or []:
        if str(key).rsplit(".", 1)[-1] not in PROJECTIONS:
            raise AdapterError(
                f"{where}: lora_parameters.keys: {key!r} is not a projection this model has "
                f"(known: {', '.join(PROJECTIONS)})"
            )
    num_layers = cfg.get("num_layers")
    if isinstance(num_layers, int) and num_layers > shape.num_layers:
        raise AdapterError(f"{where}: num_layers {num_layers} exceeds the model's {shape.num_layers} layers")
    out = {}
    modules = set()
    for key, t in tensors.items():
        m = _NAME.match(key)
        if m is None or m.group(3) not in PROJECTIONS:
            what = (
                "a DoRA magnitude"
                if key.endswith(".m")
                else "a quantized weight"
                if key.endswith((".scales", ".biases"))
                else "not a LoRA weight of an attention or MLP projection"
            )
            raise AdapterError(f"{where}: tensor {key!r} is {what}")
        if not t.is_floating_point():
            raise AdapterError(f"{where}: tensor {key!r} is {t.dtype}: quantized adapters are not supported")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= shape.num_layers:
            raise AdapterError(f"{where}: tensor {key!r}: the model has {shape.num_layers} layers")
        modules.add(module)
        out[f"base_model.model.model.layers.{layer}.{block}.{module}.lora_{ab.upper()}.weight"] = t.t().contiguous()
    if not out:
        raise AdapterError(f"{where}: no LoRA tensors")
    peft = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "target_modules": sorted(modules)}
    return peft, out


def convert_mlx_adapter(weights: bytes, config: bytes, out_dir: Path, shape: ModelShape) -> Path:
    """Write `out_dir` as a PEFT adapter directory; raises ValueError/KeyError on a malformed upload."""
    cfg = json.loads(config)
    if not isinstance(cfg, dict):
        raise AdapterError("adapter_config must be a JSON object")
    peft, tensors = mlx_to_peft(cfg, load(weights), shape, "adapter_config")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"))
    (out_dir / "adapter_config.json").write_text(json.dumps(peft))
    return out_dir
