"""What every LoRA adapter reader shares (PEFT and mlx-lm layouts): the modules an adapter may target, as
(fused projection, slot), and the error a refused adapter raises."""

# PEFT module name -> (our fused projection, index of the slice)
MODULES = {
    "q_proj": ("qkv", 0),
    "k_proj": ("qkv", 1),
    "v_proj": ("qkv", 2),
    "o_proj": ("o", 0),
    "gate_proj": ("gate_up", 0),
    "up_proj": ("gate_up", 1),
    "down_proj": ("down", 0),
}


class AdapterError(ValueError):
    pass
