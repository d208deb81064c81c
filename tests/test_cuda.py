"""The CUDA path on a real GPU: exactness against transformers on the same card (fp32 and bf16, CUDA graphs
on and off), the KV offload tiers behind a device-memory pool, and a weight update on the device.
Every test here carries the `cuda` marker and skips cleanly on a machine without CUDA."""

from __future__ import annotations

import pytest
import torch

from rlserve.config.schema import Config, KVOffloadConfig
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.engine.weights import stage_from_dir
from rlserve.model.make import make_model
from test_engine import random_prompts

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def gpu_engine(model_dir, dtype: str, graphs: bool, **engine) -> Engine:
    cfg = Config()
    cfg.model.name, cfg.model.device, cfg.model.dtype = str(model_dir), "cuda", dtype
    cfg.model.enforce_eager = not graphs
    cfg.model.max_model_len = engine.pop("max_model_len", 1024)
    cfg.engine.kv_cache_bytes = engine.pop("kv_cache_bytes", 32 << 20)
    offload = engine.pop("offload", None)
    if offload is not None:
        cfg.kv_cache_offload = KVOffloadConfig.model_validate(offload)
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return Engine(cfg)


def reference_logprobs(hf, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log_softmax at each completion position from one transformers forward pass on the GPU."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion], device="cuda")).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(completion)], dim=-1).cpu()


@pytest.fixture(scope="module")
def hf_gpu(model_dir):
    from transformers import AutoModelForCausalLM

    return {
        dtype: AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to("cuda").eval()
        for dtype in ("float32", "bfloat16")
    }


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_fp32_greedy_ids_and_logprobs_equal_transformers_on_the_gpu(model_dir, hf_gpu, graphs):
    engine = gpu_engine(model_dir, "float32", graphs)
    prompts = random_prompts(6, engine.vocab_size, lo=5, hi=60, seed=31)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0))
    assert (engine.runner.graphs is not None and bool(engine.runner.graphs.graphs)) == graphs
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = reference_logprobs(hf_gpu["float32"], prompt, comp.token_ids)
        assert comp.token_ids == ref.argmax(-1).tolist()  # teacher-forced greedy: every token is the argmax
        got = torch.tensor(comp.logprobs)
        assert torch.allclose(got, ref.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0], atol=1e-4)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_bf16_logprobs_stay_close_to_the_fp32_forward(model_dir, hf_gpu, graphs):
    """bf16 rounds every matmul: ids may differ at near-ties, so compare the sampled tokens' logprobs
    with the fp32 forward of the same tokens (the LM head and log_softmax run in fp32)."""
    engine = gpu_engine(model_dir, "bfloat16", graphs)
    prompts = random_prompts(6, engine.vocab_size, lo=5, hi=60, seed=32)
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=0))
    diffs = []
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = reference_logprobs(hf_gpu["float32"], prompt, comp.token_ids)
        diffs.append((torch.tensor(comp.logprobs) - ref.gather(1, torch.tensor(comp.token_ids)[:, None])[:, 0]).abs())
    diffs = torch.cat(diffs)
    assert diffs.mean() < 0.05 and diffs.max() < 0.5


def test_kv_offload_tiers_behind_a_device_pool_give_the_same_outputs(model_dir):
    """A pool of 24 blocks under a 4 x 96-token multi-turn workload: turn 2 finds its history in the
    pinned CPU tier (copied on a side stream) and must reproduce the no-offload outputs."""
    convs = random_prompts(4, 2048, lo=96, hi=97, seed=33)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0)
    runs = []
    for offload in (None, {"cpu": {"num_bytes": 8 << 20}}):
        engine = gpu_engine(
            model_dir,
            "float32",
            False,
            max_model_len=384,
            kv_cache_bytes=24 * 16 * 2048,
            block_size=16,
            offload=offload,
        )
        outs = [engine.generate([c[: 64 + 32 * t] for c in convs], params) for t in range(2)]
        runs.append((outs, engine.stats))
        engine.close()
    (base, _), (offloaded, stats) = runs
    assert stats.kv_offload_bytes_to_cpu > 0 and stats.kv_offload_cpu_hits > 0
    for turn_a, turn_b in zip(base, offloaded):
        for a, b in zip(turn_a, turn_b):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-4)


def test_a_weight_update_on_the_gpu_serves_the_new_weights(tmp_path, model_dir):
    from transformers import AutoModelForCausalLM

    new_dir = make_model("tiny", tmp_path / "next", seed=1)
    engine = gpu_engine(model_dir, "float32", True)
    prompt = random_prompts(1, engine.vocab_size, lo=20, hi=21, seed=34)[0]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    engine.generate([prompt], params)  # captures graphs over the old weights' storage
    engine.commit_weights(stage_from_dir(engine.model, new_dir))
    out = engine.generate([prompt], params)[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).to("cuda").eval()
    ref = reference_logprobs(hf, prompt, out.token_ids)
    assert out.token_ids == ref.argmax(-1).tolist()
    assert torch.allclose(
        torch.tensor(out.logprobs), ref.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0], atol=1e-4
    )
