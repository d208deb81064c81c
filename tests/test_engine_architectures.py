"""Other members of the Llama family load and match transformers: Qwen2 (qkv bias, untied
embeddings) and Llama with untied embeddings, built as tiny random checkpoints here."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import default_model_dir
from test_engine import assert_matches_hf

SHAPE = dict(
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=2048,
    max_position_embeddings=512,
    tie_word_embeddings=False,
)


@pytest.mark.parametrize("config_cls", [Qwen2Config, LlamaConfig])
def test_family_member_matches_transformers(tmp_path, config_cls):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config_cls(**SHAPE), dtype=torch.float32).eval()
    with torch.no_grad():  # default init is near-uniform: widen it so greedy has clear winners
        for name, p in hf.named_parameters():
            if p.dim() > 1 or name.endswith("bias"):
                p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path)
    for f in default_model_dir().glob("tokenizer*"):
        shutil.copy(f, tmp_path)
    if config_cls is Qwen2Config:
        assert any(n.endswith("q_proj.bias") for n, _ in hf.named_parameters())
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len, cfg.engine.kv_cache_bytes = str(tmp_path), 256, 8 << 20
    engine = Engine(cfg)
    prompts = [[5, 17, 300, 2], [1000, 3, 3, 3, 9, 12, 40]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0))
    assert_matches_hf(hf, prompts, outs)
