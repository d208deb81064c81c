"""A model's shape as the engine and the server see it (ModelShape, MoeShape), read from its HF config; light:
the HTTP side imports this, not the model code."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    rope_scaling: dict | None = None
    moe: MoeShape | None = None  # Qwen3-MoE: the expert blocks

    @classmethod
    def from_dict(cls, fields: dict) -> ModelShape:
        """The shape an engine process sent as a plain mapping (its expert block a mapping too)."""
        moe = fields.get("moe")
        if moe is not None:
            moe = MoeShape(**{**moe, "sparse_layers": tuple(moe["sparse_layers"])})
        return cls(**{**fields, "moe": moe})

    @classmethod
    def from_hf(cls, cfg) -> ModelShape:
        model_type = getattr(cfg, "model_type", "llama")
        if model_type not in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral"):
            raise ValueError(
                f"model_type {model_type!r} is not supported; rlserve serves llama, mistral, qwen2, qwen3 and qwen3_moe"
            )
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        rope_scaling = getattr(cfg, "rope_scaling", None)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) not in (None, "default", "llama3"):
            raise ValueError(f"rope_scaling {rope_scaling} is not supported")
        rope_theta = getattr(cfg, "rope_theta", None)
        if rope_theta is None:  # transformers 5 keeps it in rope_parameters
            rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=cfg.num_attention_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(rope_theta),
            max_position_embeddings=cfg.max_position_embeddings,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            rope_scaling=rope_scaling
            if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3"
            else None,
            moe=MoeShape.from_hf(cfg, cfg.num_hidden_layers) if model_type == "qwen3_moe" else None,
        )


@dataclass(frozen=True, slots=True)
class MoeShape:
    num_experts: int
    top_k: int
    norm_topk_prob: bool
    intermediate_size: int  # of one expert
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the expert block

    @classmethod
    def from_hf(cls, cfg, num_layers: int) -> MoeShape:
        step = getattr(cfg, "decoder_sparse_step", 1) or 1
        dense = set(getattr(cfg, "mlp_only_layers", None) or [])
        sparse = tuple(i for i in range(num_layers) if i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0)
        if cfg.num_experts_per_tok > cfg.num_experts:
            raise ValueError(f"num_experts_per_tok ({cfg.num_experts_per_tok}) exceeds num_experts ({cfg.num_experts})")
        return cls(
            cfg.num_experts, cfg.num_experts_per_tok, bool(cfg.norm_topk_prob), cfg.moe_intermediate_size, sparse
        )

    @property
    def expert_id_dtype(self) -> torch.dtype:
        return torch.uint8 if self.num_experts <= 256 else torch.int16
