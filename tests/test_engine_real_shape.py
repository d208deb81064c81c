"""Greedy decoding and logprobs on a SmolLM2-135M-shaped model (Llama architecture, real shapes)."""

from __future__ import annotations

import subprocess
import sys

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


FAULT_PROBE = """
import resource, sys, torch
import rlserve.engine.engine as engine_module
from rlserve.config import Config
from rlserve.engine.params import SamplingParams
if sys.argv[2] == "untuned":
    engine_module.keep_freed_memory = lambda: False
cfg = Config()
cfg.model.name = sys.argv[1]
cfg.model.max_model_len = 256
cfg.engine.pack_weights = False  # unpacked weights: sgemm packs each into a fresh buffer every call
engine = engine_module.Engine(cfg)
gen = torch.Generator().manual_seed(0)
for i in range(4):
    engine.add_request(str(i), torch.randint(100, 40000, (64,), generator=gen).tolist(),
                       SamplingParams(n=8, temperature=1.0, max_tokens=64, ignore_eos=True, seed=i))
for _ in range(4):  # prefill and the first decode steps settle the heap
    engine.step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    engine.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def decode_page_faults(model_dir, mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", FAULT_PROBE, str(model_dir), mode], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="tunes glibc malloc")
def test_decode_steps_reuse_freed_pages(model_dir):
    # 32 sequences on unpacked weights: glibc hands sgemm's multi-megabyte packing buffers back to
    # the kernel and faults them in again (thousands of faults a step) unless the engine keeps
    # freed memory mapped
    assert decode_page_faults(model_dir, "untuned") > 4 * 1000
    assert decode_page_faults(model_dir, "tuned") < 4 * 100
