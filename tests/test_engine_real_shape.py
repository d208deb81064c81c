"""Greedy decoding and logprobs on a SmolLM2-135M-shaped model (Llama architecture, real shapes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.config import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from test_engine import assert_matches_hf
from rlserve.model.make import make_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("smollm2-135m", tmp_path_factory.mktemp("models") / "smollm2-135m")


def test_greedy_and_logprobs_match_transformers(model_dir):
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = 256
    cfg.engine.kv_cache_bytes = 64 << 20
    engine = Engine(cfg)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [engine.tokenizer.encode("The capital of France is"), [11, 2000, 40000, 7, 123, 999], [42]]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
    assert_matches_hf(hf, prompts, outs)
