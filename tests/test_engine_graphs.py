"""The static-shape decode path that CUDA graphs capture, run eagerly on CPU (capture=False):
padded batches, bucketed widths and the scratch block must leave every real row's result exact."""

from __future__ import annotations

import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.graphs import MAX_GATHERED_TOKENS, DecodeGraphs, batch_bucket, width_bucket
from rlserve.engine.params import SamplingParams
from test_engine import hf_logprobs, make_engine, random_prompts


def test_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 100)] == [1, 2, 4, 8, 8, 16, 16, 32, 112]
    assert [width_bucket(b) for b in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]


def test_buckets_past_the_limits_run_eagerly(model_dir):
    engine = make_engine(model_dir, cascade_attention=False)
    engine.runner.use_decode_graphs(max_batch=32, max_model_len=1024, capture=False)
    graphs = engine.runner.graphs
    assert graphs.bucket(20, 3) == (32, 4)
    assert graphs.bucket(33, 3) is None  # more sequences than the largest graph
    assert graphs.bucket(1, 65) is None  # wider than max_model_len's blocks
    engine.runner.use_decode_graphs(max_batch=256, max_model_len=1 << 16, capture=False)
    graphs = engine.runner.graphs
    assert 128 * 64 * graphs.block_size == MAX_GATHERED_TOKENS
    assert graphs.bucket(128, 64) == (128, 64)
    assert graphs.bucket(129, 64) is None  # 144 x 64 blocks: over the gather budget


@pytest.fixture
def counted(monkeypatch):
    """The graph keys each decode step ran in."""
    keys: list[tuple[int, int]] = []
    forward = DecodeGraphs.forward

    def spy(self, key, *args):
        keys.append(key)
        return forward(self, key, *args)

    monkeypatch.setattr(DecodeGraphs, "forward", spy)
    return keys


def test_padded_decode_matches_transformers(model_dir, hf, counted):
    engine = make_engine(model_dir, cascade_attention=False)
    engine.runner.use_decode_graphs(max_batch=64, max_model_len=1024, capture=False)
    # 11 sequences (5 padding rows in a 16-row graph) whose contexts cross block boundaries while
    # decoding, so the width bucket changes mid-run; n=2 makes two rows share prompt blocks
    prompts = random_prompts(9, engine.vocab_size, lo=3, hi=14, seed=21)
    params = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=i) for i in range(9)]
    params[0] = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=99)
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            want = (
                hf_logprobs(hf, prompt, comp.token_ids).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
            )
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4)
    assert (16, 4) in counted and len({w for _, w in counted}) > 1  # padded rows, several widths
    assert engine.pool.num_blocks == engine.runner.scratch_block  # the pool never hands it out


def test_greedy_tokens_equal_the_eager_engine(model_dir, counted):
    prompts = random_prompts(5, 2048, lo=10, hi=30, seed=4)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    eager = make_engine(model_dir, cascade_attention=False).generate(prompts, params)
    engine = make_engine(model_dir, cascade_attention=False)
    engine.runner.use_decode_graphs(max_batch=8, max_model_len=1024, capture=False)
    graphed = engine.generate(prompts, params)
    assert counted and all(b == 8 for b, _ in counted)
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_cuda_graphs_match_eager_decode(model_dir):
    def engine_on_gpu(enforce_eager: bool) -> Engine:
        cfg = Config()
        cfg.model.name, cfg.model.max_model_len, cfg.engine.kv_cache_bytes = str(model_dir), 1024, 32 << 20
        cfg.model.device, cfg.model.enforce_eager = "cuda", enforce_eager
        return Engine(cfg)

    # 8 sequences fill the 8-row graph: the same GEMM shapes as eager, so bf16 rounding agrees
    prompts = random_prompts(8, 2048, lo=5, hi=40, seed=13)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    eager = engine_on_gpu(True).generate(prompts, params)
    engine = engine_on_gpu(False)
    graphed = engine.generate(prompts, params)
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured and replayed
    for a, b in zip(eager, graphed):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-2)
