"""Which device and dtypes an engine runs in, from the config's names ('auto' included)."""

from __future__ import annotations

import torch

from rlserve.model.cpu_kernels import cpu_has_native_bf16, warn_slow_half_precision
from rlserve.model.llama import logits_dtype

HALF_DTYPES = (torch.bfloat16, torch.float16)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name)
    if device.type == "cpu" and dtype in HALF_DTYPES and not cpu_has_native_bf16():
        warn_slow_half_precision(name)
    return dtype


def resolve_head_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The LM head's dtype: float32 (auto; float64 for a float64 model) or the model's own; a third dtype
    is a config error."""
    dtype = logits_dtype(model_dtype) if name == "auto" else getattr(torch, name)
    if dtype not in (torch.float32, model_dtype):
        raise ValueError(f"model.lm_head_dtype={name} must be float32, auto or the model dtype ({model_dtype})")
    return dtype
