"""The C kernels: each equal to the PyTorch ops it replaces, used by the engine with exact
logprobs, and a clean fallback where they cannot be built."""

from __future__ import annotations

import logging

import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model import cpu_kernels as kernels_module
from rlserve.model.cpu_kernels import CpuKernels, cpu_kernels, reference_paged_attention
from rlserve.model.llama import rms_norm
from rlserve.model.rope import apply_rope
from test_engine import hf_logprobs, make_engine, random_prompts


@pytest.fixture(scope="module")
def kernels() -> CpuKernels:
    k = cpu_kernels()
    # this machine (and CI) has gcc: kernels that silently fell back would hide every check below
    assert k is not None, "the CPU kernels did not build; see the warning logged"
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


DECODE_STEP_LENS = [1, 16, 17, 100, 112, 3, 40] * 4  # 28 rows: enough that each row's KV heads are one work item


@pytest.mark.parametrize(
    "kv_heads, group, head_dim, block_size, lens",
    [
        (3, 3, 64, 16, [1, 16, 17, 100, 112]),  # SmolLM2's heads; exactly full blocks and one token
        (3, 3, 64, 16, DECODE_STEP_LENS),  # a decode step: whole rows per work item
        (8, 2, 128, 16, [5, 64, 300]),  # Qwen3-0.6B's heads
        (2, 2, 32, 16, [7, 33]),  # tiny
        (1, 8, 48, 4, [2, 9, 13]),  # a head size with no special-cased build, small blocks
        (4, 1, 64, 32, [40, 1]),  # no grouping (MHA)
    ],
)
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_attention_equals_gather_and_sdpa(kernels, kv_heads, group, head_dim, block_size, lens, dtype, atol):
    """Decode rows of several sequences (bf16 with native bf16: each row's KV heads in one work item,
    the threads fetching their next row's chunks ahead) against attention over the gathered KV."""
    q, k_cache, v_cache, tables, ctx_lens = case(len(lens), len(lens), kv_heads, group, head_dim, block_size, lens)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    scale = head_dim**-0.5
    got = kernels.attention(q, k_cache, v_cache, tables, ctx_lens, block_size, scale)
    want = reference_paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, ctx_lens, block_size, scale)
    assert torch.allclose(got.float(), want, atol=atol), (got.float() - want).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_gives_each_row_the_bits_it_gets_alone(kernels, dtype):
    """A decode step of many rows runs each row's KV heads as one work item (fetching the next row
    ahead); a row alone splits by KV head. Each query head does the same operations either way."""
    lens = DECODE_STEP_LENS
    q, k_cache, v_cache, tables, ctx_lens = case(7, len(lens), 3, 3, 64, 16, lens)
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    step = kernels.attention(q, k_cache, v_cache, tables, ctx_lens, 16, 0.125)
    alone = torch.cat(
        [kernels.attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], ctx_lens[i : i + 1], 16, 0.125)
         for i in range(len(lens))]
    )  # fmt: skip
    assert torch.equal(step, alone)


def prompt_rows(seed: int, length: int, kv_heads: int, group: int, head_dim: int, block_size: int, first: int = 1):
    """Rows of one sequence's prompt at positions first-1 .. length-1, as the runner sends them: one
    table (repeated) and contexts first .. length, so the kernel takes them as tiles."""
    gen = torch.Generator().manual_seed(seed)
    width = -(-length // block_size)
    k_cache, v_cache = torch.randn(2, (width + 2) * block_size, kv_heads, head_dim, generator=gen).unbind(0)
    table = torch.randperm(width + 2, generator=gen)[:width]
    rows = length - first + 1
    q = torch.randn(rows, kv_heads * group, head_dim, generator=gen)
    lens = torch.arange(first, length + 1)
    return q, k_cache.contiguous(), v_cache.contiguous(), table.expand(rows, width).contiguous(), lens


@pytest.mark.parametrize("invariant", [False, True])
@pytest.mark.parametrize(
    "length, kv_heads, group, head_dim, block_size, first",
    [
        (70, 3, 3, 64, 16, 1),  # SmolLM2's heads: tiles of 16 rows, chunks of 16 keys, a ragged end
        (40, 2, 4, 48, 4, 5),  # a head size that is not a multiple of 16, small blocks, a chunk start
        (33, 1, 1, 32, 32, 1),  # one query vector per row: tiles of 48 rows
        (20, 1, 32, 16, 8, 10),  # the widest group: one row per tile
        (45, 2, 2, 128, 16, 3),  # a 128 head size; tiles of 24 rows, two lane vectors and a ragged last tile
        (30, 1, 16, 18, 8, 1),  # a head size the AVX2 lanes form does not take (D % 4): plain C there
    ],
)
def test_prompt_rows_attend_as_tiles(kernels, invariant, length, kv_heads, group, head_dim, block_size, first):
    """A prompt's rows go through the kernel together, a tile of consecutive positions sharing each K
    and V read; each row still equals attention over its own prefix. The batch-invariant build also
    gives each row the bits it gets alone (a decode row at that position)."""
    from rlserve.model.invariant_ops import invariant_kernels

    built = invariant_kernels() if invariant else kernels
    q, k_cache, v_cache, tables, lens = prompt_rows(length, length, kv_heads, group, head_dim, block_size, first)
    for dtype, atol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        qd, kd, vd = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
        got = built.attention(qd, kd, vd, tables, lens, block_size, head_dim**-0.5)
        want = reference_paged_attention(qd.float(), kd.float(), vd.float(), tables, lens, block_size, head_dim**-0.5)
        assert torch.allclose(got.float(), want, atol=atol), (dtype, (got.float() - want).abs().max())
        if invariant:
            alone = torch.cat(
                [built.attention(qd[i : i + 1], kd, vd, tables[i : i + 1], lens[i : i + 1], block_size, head_dim**-0.5)
                 for i in range(len(lens))]
            )  # fmt: skip
            assert torch.equal(got, alone), dtype


def test_prompt_tiles_take_the_lanes_form_of_the_cpus_vectors(kernels, model_dir):
    """fp32 prompt tiles take a lanes form wherever the CPU has wide FMAs (AVX-512, or AVX2 + FMA in
    the default build), and the engine sends prompt rows through them; the batch-invariant build on
    AVX2 keeps the per-query form, whose bits a decode row shares."""
    from rlserve.model.invariant_ops import invariant_kernels

    flags = {f for ln in open("/proc/cpuinfo") if ln.startswith("flags") for f in ln.split(":", 1)[1].split()}
    avx512, avx2 = {"avx512f", "avx512bw", "avx512vl"} <= flags, {"avx2", "fma"} <= flags
    expected = 512 if avx512 else 256 if avx2 else 0
    assert kernels.attention_lanes(torch.float32) == expected
    assert invariant_kernels().attention_lanes(torch.float32) == (512 if avx512 else 0)
    assert make_engine(model_dir).runner.prompt_rows_in_kernel == (expected > 0)


def test_rows_of_different_sequences_never_share_a_tile(kernels):
    """Consecutive contexts alone do not make a tile: two sequences whose rows happen to follow each
    other (5 then 6) but whose tables differ each read their own blocks."""
    q, k_cache, v_cache, tables, lens = case(3, 2, 2, 2, 32, 4, [5, 6])
    tables[1, 0] = (tables[0, 0] + 1) % k_cache.shape[0]  # the second row's first block differs
    got = kernels.attention(q, k_cache, v_cache, tables, lens, 4, 0.2)
    assert torch.allclose(got, reference_paged_attention(q, k_cache, v_cache, tables, lens, 4, 0.2), atol=1e-5)


def test_attention_reads_the_query_as_a_view_into_qkv_rows(kernels):
    q, k_cache, v_cache, tables, ctx_lens = case(0, 3, 2, 2, 32, 16, [20, 3, 40])
    wide = torch.cat((q, torch.full_like(q, 1e9)), 1)[:, : q.shape[1]]
    assert not wide.is_contiguous()
    got = kernels.attention(wide, k_cache, v_cache, tables, ctx_lens, 16, 0.2)
    assert torch.allclose(got, reference_paged_attention(q, k_cache, v_cache, tables, ctx_lens, 16, 0.2), atol=1e-5)


@pytest.mark.parametrize("rows", [1, 7, 64, 512])  # 512 rows: enough work to split across threads
@pytest.mark.parametrize("transposed_delta", [False, True])
def test_add_rms_norm_equals_the_torch_ops(kernels, rows, transposed_delta):
    gen = torch.Generator().manual_seed(rows)
    hidden, weight = torch.randn(rows, 576, generator=gen), torch.randn(576, generator=gen)
    delta = torch.randn(576, rows, generator=gen).t() if transposed_delta else torch.randn(rows, 576, generator=gen)
    want_hidden = hidden + delta
    want = rms_norm(want_hidden, weight, 1e-5)
    out = torch.empty_like(hidden)
    kernels.add_rms_norm(hidden, delta, weight, out, 1e-5)
    assert torch.allclose(hidden, want_hidden, atol=1e-6) and torch.allclose(out, want, atol=1e-5)
    kernels.add_rms_norm(hidden, None, weight, out, 1e-5)  # no residual: the norm alone, hidden untouched
    assert torch.allclose(hidden, want_hidden, atol=1e-6) and torch.allclose(out, want, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("t", [5, 600])  # 600 tokens: enough work to split across threads
def test_qk_rope_store_equals_the_torch_ops(kernels, qk_norm, t):
    gen = torch.Generator().manual_seed(int(qk_norm))
    nh, nkv, d, slots_total = 4, 2, 64, 1000
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=gen)
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).unsqueeze(1)
    q_norm, k_norm = (torch.randn(d, generator=gen), torch.randn(d, generator=gen)) if qk_norm else (None, None)
    slots = torch.randperm(slots_total, generator=gen)[:t]
    heads = qkv.clone().view(t, nh + 2 * nkv, d)
    qk = heads[:, : nh + nkv]
    if qk_norm:
        qk = torch.cat((rms_norm(qk[:, :nh], q_norm, 1e-6), rms_norm(qk[:, nh:], k_norm, 1e-6)), 1)
    qk = apply_rope(qk, cos, sin)
    k_cache, v_cache = torch.zeros(2, slots_total, nkv, d).unbind(0)
    kernels.qk_rope_store(qkv, cos, sin, q_norm, k_norm, 1e-6, slots, k_cache, v_cache, nh, nkv)
    got = qkv.view(t, nh + 2 * nkv, d)
    assert torch.allclose(got[:, : nh + nkv], qk, atol=1e-5)
    assert torch.equal(got[:, nh + nkv :], heads[:, nh + nkv :])  # v is left as it was
    assert torch.equal(k_cache[slots], got[:, nh : nh + nkv]) and torch.equal(v_cache[slots], heads[:, nh + nkv :])
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("rows", [9, 200])  # one thread; split across threads (PARALLEL_MIN_WORK)
def test_silu_mul_equals_the_torch_ops(kernels, rows):
    gate_up = torch.randn(rows, 2 * 1536, generator=torch.Generator().manual_seed(0)) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up, atol=1e-5)


GEMV_SHAPES = [  # (in, out): SmolLM2's projections; odd sizes that leave tails of the 16/32-wide loads and 4-output tiles
    (576, 960),
    (1536, 576),
    (37, 9),
    (17, 3),
    (33, 1),
    (1, 5),
]


@pytest.mark.parametrize(
    "rows", [1, 3, 4, 5, 8, 9, 16, 17]
)  # partial and full 4-row tiles, both sides of the row limits
@pytest.mark.parametrize("k, n", GEMV_SHAPES)
def test_gemv_equals_linear_fp32(kernels, rows, k, n):
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, weight, bias = (
        torch.randn(rows, k, generator=gen),
        torch.randn(n, k, generator=gen),
        torch.randn(n, generator=gen),
    )
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double()).float()
    assert torch.allclose(kernels.gemv(x, weight, bias), want, atol=1e-4, rtol=1e-5)
    assert torch.allclose(kernels.gemv(x, weight), want - bias, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 16, 17])
@pytest.mark.parametrize("k, n", GEMV_SHAPES)
def test_gemv_bf16_rounds_the_fp32_sum_of_bf16_products(kernels, rows, k, n):
    """bf16 in and out: the exact sum of the bf16 products rounded once to bf16 (half a bf16 step,
    at most 2^-8 of the value), plus the fp32 accumulation's own error (tiny: ~1e-7 per product)."""
    gen = torch.Generator().manual_seed(rows * 1000 + k + n)
    x, weight, bias = (torch.randn(rows, k, generator=gen).bfloat16(), torch.randn(n, k, generator=gen).bfloat16(),
                       torch.randn(n, generator=gen).bfloat16())  # fmt: skip
    want = torch.nn.functional.linear(x.double(), weight.double(), bias.double())
    got = kernels.gemv(x, weight, bias)
    assert got.dtype == torch.bfloat16
    assert ((got.double() - want).abs() <= want.abs() * 2.0**-8 + 1e-5 * k).all()


@pytest.mark.parametrize("rows", [1, 3, 203])  # one row: the row-at-a-time dot; more: the 4-row tiles, in blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_split_across_threads_equals_one_thread(kernels, dtype, rows):
    """Enough work to pass PARALLEL_MIN_WORK: the outputs split across the caller and 1, 2 or 4
    helpers of parallel.c's pool (more threads than this machine's cores too), tiles unchanged."""
    gen = torch.Generator().manual_seed(3)
    x, weight = torch.randn(rows, 1536, generator=gen).to(dtype), torch.randn(3073, 1536, generator=gen).to(dtype)
    one = kernels.gemv(x, weight, threads=1)
    for threads in (2, 3, 5, 2):
        assert torch.equal(kernels.gemv(x, weight, threads=threads), one), threads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_kernels_split_across_threads_equal_one_thread(kernels, dtype):
    """Attention, residual + RMSNorm and SiLU x up take torch's thread count into the same pool:
    a row (or a sequence's KV head) is one thread's work in one order, whatever the count."""
    q, k_cache, v_cache, tables, lens = case(5, 24, 2, 3, 64, 16, [700 - 29 * i for i in range(24)])
    q, k_cache, v_cache = q.to(dtype), k_cache.to(dtype), v_cache.to(dtype)
    gen = torch.Generator().manual_seed(6)
    hidden, delta = torch.randn(2, 300, 1024, generator=gen).to(dtype).unbind(0)
    weight, gate_up = torch.randn(1024, generator=gen).to(dtype), torch.randn(300, 2048, generator=gen).to(dtype)

    def outputs():
        h, out = hidden.clone(), torch.empty_like(hidden)
        kernels.add_rms_norm(h, delta, weight, out, 1e-6)
        return kernels.attention(q, k_cache, v_cache, tables, lens, 16, 0.125), h, out, kernels.silu_mul(gate_up)

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = outputs()
        for n in (2, 3, 5):
            torch.set_num_threads(n)
            assert all(torch.equal(a, b) for a, b in zip(outputs(), one)), n
    finally:
        torch.set_num_threads(threads)


def test_projections_take_the_gemv_up_to_its_row_limit_and_see_weight_updates(kernels, model_dir, monkeypatch):
    """A model's projections (and LM head) go through the GEMV at few rows and through the packed
    GEMM above; both equal F.linear, and an in-place weight update reaches the GEMV at once."""
    from transformers import AutoConfig

    from rlserve.model.linear import Projection
    from rlserve.model.loader import load_model
    from rlserve.model.shape import ModelShape

    shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))
    model = load_model(model_dir, shape, torch.float32, torch.device("cpu"))
    model.pack_weights()
    model.use_gemv(kernels)
    calls = []
    real_gemv = kernels.gemv
    monkeypatch.setattr(kernels, "gemv", lambda *a, **kw: calls.append(a[0].shape[0]) or real_gemv(*a, **kw))
    proj = next(m for m in model.modules() if isinstance(m, Projection))
    limit = kernels.gemv_rows(torch.float32)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, proj.in_features, generator=gen)
        want = torch.nn.functional.linear(x, proj.weight, proj.bias)
        assert torch.allclose(proj(x), want, atol=1e-4)
        hidden = torch.randn(rows, model.shape.hidden_size, generator=gen)
        assert torch.allclose(
            model.compute_logits(hidden), torch.nn.functional.linear(hidden, model.head_weight), atol=1e-4
        )
    assert calls == [1, 1, limit, limit]  # the projection and the head at 1 and at the limit; none above
    with torch.no_grad():
        proj.weight.mul_(2)
    x = torch.randn(1, proj.in_features, generator=gen)
    assert torch.allclose(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), atol=1e-4)


def bf16_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference in units of bf16 rounding at each value's size."""
    ulp = want.float().abs().clamp_min(1e-3) * 2.0**-8
    return ((got.float() - want.float()).abs() / ulp).max().item()


def test_bf16_instances_follow_transformers_bf16_ops(kernels):
    """The bf16 kernels on bf16 tensors against the same steps as transformers runs them in bf16
    eager ops: a few bf16 roundings apart at most (they round once where it rounds per op)."""
    gen = torch.Generator().manual_seed(11)
    hidden, delta = (torch.randn(2, 7, 576, generator=gen) * 3).bfloat16().unbind(0)
    weight = torch.randn(576, generator=gen).bfloat16()
    residual = hidden + delta  # bf16 add, rounded
    normed = residual.float() * torch.rsqrt(residual.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    want = weight * normed.bfloat16()  # LlamaRMSNorm: the normed value rounded, then the weight
    out = torch.empty_like(hidden)
    kernels.add_rms_norm(hidden, delta, weight, out, 1e-5)
    assert torch.equal(hidden, residual) and bf16_ulps(out, want) <= 4

    gate_up = (torch.randn(9, 2 * 1536, generator=gen) * 4).bfloat16()
    gate, up = gate_up.chunk(2, dim=-1)
    assert bf16_ulps(kernels.silu_mul(gate_up), torch.nn.functional.silu(gate) * up) <= 4

    q, k_cache, v_cache, tables, lens = case(5, 4, 3, 3, 64, 16, [1, 17, 60, 100])
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    want = reference_paged_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, 16, 0.125)
    got = kernels.attention(q, k_cache, v_cache, tables, lens, 16, 0.125)
    assert got.dtype == torch.bfloat16 and torch.allclose(got.float(), want, atol=2e-2)

    t, nh, nkv, d = 3, 4, 2, 64
    qkv = torch.randn(t, (nh + 2 * nkv) * d, generator=gen).bfloat16()
    angles = torch.rand(t, d // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).unsqueeze(1).bfloat16()
    sin = torch.cat((-angles.sin(), angles.sin()), -1).unsqueeze(1).bfloat16()
    want = apply_rope(qkv.view(t, -1, d)[:, : nh + nkv], cos, sin)
    k_cache, v_cache = torch.zeros(2, 8, nkv, d, dtype=torch.bfloat16).unbind(0)
    kernels.qk_rope_store(qkv, cos, sin, None, None, 1e-6, torch.tensor([1, 5, 2]), k_cache, v_cache, nh, nkv)
    assert torch.allclose(qkv.view(t, -1, d)[:, : nh + nkv].float(), want.float(), atol=3e-2)
    assert torch.equal(k_cache[[1, 5, 2]], qkv.view(t, -1, d)[:, nh : nh + nkv])


def test_engine_runs_on_the_kernels_with_exact_logprobs(model_dir, kernels, monkeypatch):
    from transformers import AutoModelForCausalLM

    calls = []
    original, original_layers = CpuKernels.attention, CpuKernels.decode_layers

    def counted(self, q, *args):
        calls.append(q.shape[0])
        return original(self, q, *args)

    def counted_layers(self, layer_ptrs, final_norm, h, *args):  # the attention inside, called from C
        calls.append(h.shape[0])
        return original_layers(self, layer_ptrs, final_norm, h, *args)

    monkeypatch.setattr(CpuKernels, "attention", counted)
    monkeypatch.setattr(CpuKernels, "decode_layers", counted_layers)
    engine = make_engine(model_dir)
    assert engine.runner.kernels is not None and not engine.runner.cascade_attention
    prompts = random_prompts(4, engine.vocab_size, lo=10, hi=40, seed=5)
    params = SamplingParams(n=3, temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=1)
    outs = engine.generate(prompts, params)
    assert calls.count(12) >= 20  # all 12 sequences decoded in one call (prompt tokens may be rows too)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            ids = torch.tensor(comp.token_ids).unsqueeze(1)
            want = hf_logprobs(hf, prompt, comp.token_ids).gather(1, ids).squeeze(1)
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4), (
                (torch.tensor(comp.logprobs) - want).abs().max()
            )


def test_without_a_compiler_the_engine_falls_back_to_sdpa(model_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))  # nothing built there yet
    monkeypatch.setenv("CC", "/bin/false")  # a "compiler" that always fails
    cpu_kernels.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="rlserve.model.cpu_kernels"):
            engine = make_engine(model_dir)
        assert engine.runner.kernels is None and engine.runner.cascade_attention
        assert "kernels are unavailable" in caplog.text
        prompts = random_prompts(2, engine.vocab_size, seed=8)
        fallback = engine.generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    finally:
        monkeypatch.undo()  # the real compiler again, and no cached "unavailable" for later tests
        cpu_kernels.cache_clear()
    built = make_engine(model_dir).generate(prompts, SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    assert [[c.token_ids for c in o.outputs] for o in fallback] == [[c.token_ids for c in o.outputs] for o in built]


def test_the_library_is_built_once_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("RLSERVE_CACHE_DIR", str(tmp_path))
    cc = kernels_module._compiler()
    first = kernels_module._build(cc)
    stamp = first.stat().st_mtime_ns
    assert kernels_module._build(cc) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in first.parent.iterdir()] == [first.name]  # no temporary file left behind


def test_shapes_outside_the_kernels_buffers_keep_the_pytorch_path(kernels):
    assert kernels.supports(9, 3, 64, 16, torch.float32)
    assert not kernels.supports(9, 3, 63, 16, torch.float32)  # RoPE rotates halves
    assert not kernels.supports(2, 1, 512, 16, torch.float32)  # past the accumulators' size
    assert not kernels.supports(64, 1, 64, 16, torch.float32)  # more query heads per KV head than sized for
    assert not kernels.supports(9, 3, 64, 128, torch.float32)  # larger blocks than sized for
    assert kernels.supports(9, 3, 64, 16, torch.bfloat16)  # bf16 storage, fp32 arithmetic
    assert not kernels.supports(9, 3, 64, 16, torch.float16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_layers_in_one_call_equal_the_python_path(model_dir, kernels, dtype, monkeypatch):
    """A decode step of few rows runs every layer in one C call (decode_impl.h): the same kernels
    in the same order as the Python path, so tokens and logprobs are bit-identical to it, also
    after a weight is replaced by a new tensor (the addresses are read again at `refresh_packed`)."""
    if dtype == "bfloat16" and not kernels_module.cpu_has_native_bf16():
        pytest.skip("the bf16 GEMV (and so the one-call decode) runs only on CPUs with native bf16")
    cfg = Config()
    cfg.model.name, cfg.model.dtype, cfg.model.max_model_len = str(model_dir), dtype, 256
    cfg.engine.kv_cache_bytes, cfg.engine.enable_prefix_caching = 16 << 20, False
    engine = Engine(cfg)
    model = engine.runner.model
    calls = []
    real = CpuKernels.decode_layers
    monkeypatch.setattr(
        CpuKernels, "decode_layers", lambda self, ptrs, *a: calls.append(ptrs.shape[0]) or real(self, ptrs, *a)
    )
    prompts = random_prompts(3, engine.vocab_size, lo=5, hi=30, seed=9)
    params = SamplingParams(n=2, temperature=1.0, max_tokens=20, ignore_eos=True, logprobs=2, seed=4)

    def run() -> list:
        return [(c.token_ids, c.logprobs, c.top_logprobs) for o in engine.generate(prompts, params) for c in o.outputs]

    one_call = run()
    assert calls and set(calls) == {model.shape.num_layers}  # every decode step of the 6 rows took it
    model._decode_plan = False  # the Python path, layer by layer
    assert run() == one_call
    down = model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(down.weight.detach() * 1.5)  # a new tensor at a new address
    model.refresh_packed()  # what replacing a weight tensor calls for (the packed copies need it too)
    model._decode_plan = False
    python_path = run()
    model.refresh_packed()
    calls.clear()
    assert run() == python_path and calls
    assert python_path != one_call
