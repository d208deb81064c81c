"""MLX-LM LoRA adapters (lora_a [in, r], lora_b [r, out], delta = scale * x @ A @ B) to PEFT layout."""

from __future__ import annotations

import json
import re
from pathlib import Path

from safetensors.torch import load, save_file

from rlserve.model.shape import ModelShape
from rlserve.model.lora import MODULES

_NAME = re.compile(r"^(?:model\.)?(?:model\.)?layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([ab])$")


def convert_mlx_adapter(weights: bytes, config: bytes, out_dir: Path, shape: ModelShape) -> Path:
    """Write `out_dir` as a PEFT adapter directory; raises ValueError/KeyError on a malformed upload."""
    cfg = json.loads(config)
    params = cfg["lora_parameters"]
    rank, scale = int(params["rank"]), float(params.get("scale", 20.0))
    tensors = load(weights)
    out, modules = {}, set()
    for key, t in tensors.items():
        m = _NAME.match(key)
        if m is None or m.group(3) not in MODULES:
            raise ValueError(f"tensor {key!r} is not a LoRA weight of an attention or MLP projection")
        layer, block, module, ab = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if layer >= shape.num_layers:
            raise ValueError(f"tensor {key!r}: the model has {shape.num_layers} layers")
        modules.add(module)
        prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
        out[f"{prefix}.lora_{ab.upper()}.weight"] = t.t().contiguous()
    if not out:
        raise ValueError("no LoRA tensors in adapter_weights")
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(out, str(out_dir / "adapter_model.safetensors"))
    peft_cfg = {"peft_type": "LORA", "r": rank, "lora_alpha": scale * rank, "target_modules": sorted(modules)}
    (out_dir / "adapter_config.json").write_text(json.dumps(peft_cfg))
    return out_dir
