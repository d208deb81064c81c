"""The C decode-attention kernel: equal to gather + SDPA, used by the engine, and a clean fallback."""

from __future__ import annotations

import logging

import pytest
import torch

from rlserve.engine.params import SamplingParams
from rlserve.model import cpu_kernels
from rlserve.model.cpu_kernels import PagedAttention, paged_attention, reference_paged_attention
from rlserve.model.make import make_model
from test_engine import hf_logprobs, make_engine, random_prompts


@pytest.fixture(scope="module")
def kernel() -> PagedAttention:
    k = paged_attention()
    # this machine (and CI) has gcc: a kernel that silently fell back would hide every check below
    assert k is not None, "the paged-attention kernel did not build; see the warning logged"
    return k


def case(seed: int, batch: int, kv_heads: int, group: int, head_dim: int, block_size: int, lens: list[int]):
    gen = torch.Generator().manual_seed(seed)
    width = -(-max(lens) // block_size)
    num_blocks = batch * width + 3
    k_cache, v_cache = torch.randn(2, num_blocks * block_size, kv_heads, head_dim, generator=gen).unbind(0)
    tables = torch.randperm(num_blocks, generator=gen)[: batch * width].view(batch, width)
    for b, n in enumerate(lens):  # padding past a sequence's blocks is block 0, as the runner pads
        tables[b, -(-n // block_size) :] = 0
    q = torch.randn(batch, kv_heads * group, head_dim, generator=gen)
    return q, k_cache.contiguous(), v_cache.contiguous(), tables.contiguous(), torch.tensor(lens)


@pytest.mark.parametrize(
    "kv_heads, group, head_dim, block_size, lens",
    [
        (3, 3, 64, 16, [1, 16, 17, 100, 112]),  # SmolLM2's heads; exactly full blocks and one token
        (8, 2, 128, 16, [5, 64, 300]),  # Qwen3-0.6B's heads
        (2, 2, 32, 16, [7, 33]),  # tiny
        (1, 8, 48, 4, [2, 9, 13]),  # a head size with no special-cased build, small blocks
        (4, 1, 64, 32, [40, 1]),  # no grouping (MHA)
    ],
)
def test_kernel_equals_gather_and_sdpa(kernel, kv_heads, group, head_dim, block_size, lens):
    q, k_cache, v_cache, tables, ctx_lens = case(len(lens), len(lens), kv_heads, group, head_dim, block_size, lens)
    scale = head_dim**-0.5
    got = kernel(q, k_cache, v_cache, tables, ctx_lens, block_size, scale)
    want = reference_paged_attention(q, k_cache, v_cache, tables, ctx_lens, block_size, scale)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


def test_kernel_reads_a_non_contiguous_query_as_its_values(kernel):
    """The model hands the kernel q as a view into the fused QKV rows."""
    q, k_cache, v_cache, tables, ctx_lens = case(0, 3, 2, 2, 32, 16, [20, 3, 40])
    wide = torch.cat((q, torch.full_like(q, 1e9)), 1)[:, : q.shape[1]]
    assert not wide.is_contiguous()
    got = kernel(wide, k_cache, v_cache, tables, ctx_lens, 16, 0.2)
    assert torch.allclose(got, reference_paged_attention(q, k_cache, v_cache, tables, ctx_lens, 16, 0.2), atol=1e-5)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny", tmp_path_factory.mktemp("models") / "tiny")


def test_engine_decodes_through_the_kernel_with_exact_logprobs(model_dir, kernel, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    original = PagedAttention.__call__

    def counted(self, q, *args):
        calls.append(q.shape[0])
        return original(self, q, *args)

    monkeypatch.setattr(PagedAttention, "__call__", counted)
    engine = make_engine(model_dir)
    assert engine.runner.decode_kernel is not None and not engine.runner.cascade_attention
    prompts = random_prompts(4, engine.vocab_size, lo=10, hi=40, seed=5)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=1)
    outs = engine.generate(prompts, params)
    assert max(calls) == 12  # all 12 sequences decoded in one call
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            ids = torch.tensor(comp.token_ids).unsqueeze(1)
            want = hf_logprobs(hf, prompt, comp.token_ids).gather(1, ids).squeeze(1)
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4), (torch.tensor(comp.logprobs) - want).abs().max()


def test_without_a_compiler_the_engine_falls_back_to_sdpa(model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that always fails
    paged_attention.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rlserve.model.cpu_kernels"):
            engine = make_engine(model_dir)
        assert engine.runner.decode_kernel is None and engine.runner.cascade_attention
        assert "kernel is unavailable" in caplog.text
        prompts = random_prompts(2, engine.vocab_size, seed=8)
        fallback = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        monkeypatch.undo()  # the real compiler again, and no cached "unavailable" for later tests
        paged_attention.cache_clear()
    built = make_engine(model_dir).generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in fallback] == [[c.token_ids for c in o.outputs] for o in built]


def test_the_library_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))
    cc = cpu_kernels._compiler()
    first = cpu_kernels._build(cc)
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels._build(cc) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind
