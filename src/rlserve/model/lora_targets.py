"""What every LoRA adapter reader shares (PEFT and mlx-lm layouts): the error a refused adapter raises.
The modules an adapter may target are the projections of model/names.py."""


class AdapterError(ValueError):
    pass
