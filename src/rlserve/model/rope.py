"""Rotary position embeddings: the cos/sin tables (with Llama 3's frequency scaling) and their application."""

from __future__ import annotations

import torch
from torch import nn

from rlserve.model.shape import ModelShape


class RotaryEmbedding(nn.Module):
    def __init__(self, shape: ModelShape, device: torch.device):
        super().__init__()
        dim = shape.head_dim
        with torch.device("cpu"):  # real tables even when the module is built on the meta device
            inv_freq = 1.0 / (shape.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
            if shape.rope_scaling:
                inv_freq = _llama3_scale(inv_freq, shape.rope_scaling)
            positions = torch.arange(shape.max_position_embeddings, dtype=torch.float32)
            freqs = torch.outer(positions, inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

        # rotate_half(x) * sin == roll(x, half) * sin_signed: one op fewer per application
        half = dim // 2
        self.register_buffer(
            "sin_signed", torch.cat((-self.sin[:, :half], self.sin[:, half:]), dim=-1), persistent=False
        )

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the step's positions, [T, 1, head_dim]; computed once per step."""
        cos = self.cos.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_signed.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    import math

    factor, low, high = cfg["factor"], cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)
