"""LoRA adapters in PEFT layout, applied per row group so requests with different adapters share a batch."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load

from rlserve.model.loader import checked_file, read_regular
from rlserve.model.lora_targets import AdapterError
from rlserve.model.names import PROJECTIONS, dims, fused_slice
from rlserve.model.shape import ModelShape

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_NAME = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$"
)


# PEFT initialisations that rewrite the base model's weights: the adapter alone is not the policy
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq")


def check_plain_lora(cfg: dict, config_file: Path) -> None:
    """Refuse what PEFT saves for a policy other than base + B @ A: serving it as plain LoRA would be wrong."""
    unsupported = {
        "use_dora": "DoRA adapters are not supported: train without use_dora",
        "modules_to_save": "full copies of modules (modules_to_save) are not supported: train without them",
        "lora_bias": "LoRA biases are not supported: train with lora_bias=false",
        "layer_replication": "layer_replication is not supported",
        "trainable_token_indices": "trainable_token_indices is not supported",
    }
    for name, why in unsupported.items():
        if cfg.get(name):
            raise AdapterError(f"{config_file}: {name}={cfg[name]!r}: {why}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise AdapterError(
            f"{config_file}: init_lora_weights={init!r} changes the base model's weights too, which this server does "
            "not have; save the adapter converted to plain LoRA (PEFT's path_initial_model_for_weight_conversion)"
        )
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{config_file}: peft_type={cfg['peft_type']!r}: only LORA adapters are supported")


@dataclass(slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    # (layer, PEFT module) -> (A [r, in], B [out, r] with the scaling folded in)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def load_peft_adapter(
    name: str, path: Path, shape: ModelShape, dtype: torch.dtype, device: torch.device, roots: list[str] | None = None
) -> LoraAdapter:
    """Both files must be regular files resolving under `roots` (PermissionError otherwise)."""
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    mlx_weights = path / "adapters.safetensors"  # mlx_lm.lora's layout
    if not os.path.lexists(weights_file) and os.path.lexists(mlx_weights):
        weights_file = mlx_weights
    if not os.path.lexists(config_file) or not os.path.lexists(weights_file):
        raise FileNotFoundError(
            f"{path} needs adapter_config.json and adapter_model.safetensors (PEFT layout) "
            "or adapters.safetensors (mlx-lm layout)"
        )
    try:
        cfg = json.loads(read_regular(checked_file(config_file, roots)))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise AdapterError(
            f"{config_file} is not JSON ({exc}): write the adapter with PEFT's save_pretrained"
        ) from None
    if weights_file == mlx_weights:
        if not isinstance(cfg, dict):
            raise AdapterError(f"{config_file}: not a LoRA adapter config (adapter_config.json must hold an object)")
        return _load_mlx(name, path, cfg, config_file, mlx_weights, shape, dtype, device, roots)
    try:
        r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise AdapterError(f"{config_file}: not a LoRA adapter config ({exc})") from None
    check_plain_lora(cfg, config_file)
    if r < 1 or not math.isfinite(alpha):
        raise AdapterError(
            f"{config_file}: r must be a positive integer and lora_alpha a finite number, got r={r}, lora_alpha={alpha}"
        )
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise AdapterError(f"{config_file}: rank_pattern / alpha_pattern are not supported")
    return _from_peft(
        name, path, cfg, config_file, _read_tensors(weights_file, roots), weights_file, shape, dtype, device
    )


def _load_mlx(
    name: str,
    path: Path,
    cfg: dict,
    config_file: Path,
    weights_file: Path,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
    roots: list[str] | None,
) -> LoraAdapter:
    from rlserve.model.mlx_adapter import mlx_to_peft

    peft, tensors = mlx_to_peft(cfg, _read_tensors(weights_file, roots), shape, str(config_file))
    return _from_peft(name, path, peft, config_file, tensors, weights_file, shape, dtype, device)


def _read_tensors(weights_file: Path, roots: list[str] | None) -> dict[str, torch.Tensor]:
    try:
        return load(read_regular(checked_file(weights_file, roots)))
    except PermissionError:
        raise
    except Exception as exc:
        raise AdapterError(f"cannot read {weights_file}: {exc}") from None


def _from_peft(
    name: str,
    path: Path,
    cfg: dict,
    config_file: Path,
    tensors: dict[str, torch.Tensor],
    weights_file: Path,
    shape: ModelShape,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    r, alpha = int(cfg["r"]), float(cfg.get("lora_alpha", cfg["r"]))
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    sizes = dims(shape)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _NAME.match(key)
        if m is None or m.group(2) not in PROJECTIONS or int(m.group(1)) >= shape.num_layers:
            raise AdapterError(
                f"{weights_file}: tensor {key!r} does not fit this model (only attention/MLP projections)"
            )
        if shape.moe is not None and int(m.group(1)) in shape.moe.sparse_layers and m.group(2) not in _ATTENTION:
            raise AdapterError(
                f"{weights_file}: {key!r}: layer {m.group(1)} is a mixture-of-experts layer; "
                "LoRA applies to its attention projections only"
            )
        pairs.setdefault((int(m.group(1)), m.group(2)), {})[m.group(3)] = t
    weights = {}
    for (layer, module), ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{weights_file}: layer {layer} {module} lacks lora_A or lora_B")
        fan_in, fan_out = sizes[module]
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
            raise AdapterError(
                f"{weights_file}: layer {layer} {module} has A {list(a.shape)} B {list(b.shape)}, "
                f"expected A {[r, fan_in]} B {[fan_out, r]}"
            )
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"{weights_file}: layer {layer} {module}: LoRA weights must be floating point")
        if not (torch.isfinite(a.sum()) and torch.isfinite(b.sum())):  # NaN and inf survive a sum
            raise AdapterError(f"{weights_file}: layer {layer} {module} contains NaN or infinite values")
        weights[(layer, module)] = (a.to(device, dtype), (b.float() * scaling).to(device, dtype))
    if not weights:
        raise AdapterError(f"{weights_file}: no LoRA tensors")
    return LoraAdapter(name, str(path), r, weights)


@dataclass(slots=True)
class LoraBatch:
    """Rows of the step's packed batch that run under each adapter."""

    segments: list[tuple[LoraAdapter, torch.Tensor]]
    shape: ModelShape

    def apply(self, out: torch.Tensor, x: torch.Tensor, layer: int, modules: tuple[str, ...]) -> None:
        for adapter, rows in self.segments:
            xs = None
            for module in modules:
                ab = adapter.weights.get((layer, module))
                if ab is None:
                    continue
                if xs is None:
                    xs = x.index_select(0, rows)
                start, size = fused_slice(self.shape, module)
                delta = (xs @ ab[0].t()) @ ab[1].t()
                out.narrow(1, start, size).index_add_(0, rows, delta)
