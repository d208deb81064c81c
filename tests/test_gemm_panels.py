"""Batch-invariant mode's GEMM (kernels/gemm_impl.h): equal to F.linear, each row's bits the same at
any row count, packed once or per call, and a packed copy that follows in-place weight updates."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlserve.model.invariant_ops import invariant_kernels

SHAPES = [  # rows, K, N: tile edges in rows (8), outputs (48, 16) and an odd K (bf16 pairs)
    (1, 37, 9),
    (17, 70, 37),
    (40, 33, 100),
    (9, 576, 960),
    (23, 1536, 576),
    (64, 576, 960),  # a decode step's QKV: 8 row tiles, each panel's later tiles prefetching the next
]


@pytest.fixture(scope="module")
def kernels():
    return invariant_kernels()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, k, n", SHAPES)
def test_gemm_equals_linear_and_each_row_alone(kernels, dtype, rows, k, n):
    gen = torch.Generator().manual_seed(rows * k + n)
    x, w = torch.randn(rows, k, generator=gen).to(dtype), torch.randn(n, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    panels = kernels.gemm_pack(w)
    sums = kernels.gemv(x, w, bias, fp32_out=True)
    want = F.linear(x.double(), w.double(), bias.double())
    assert (sums.double() - want).abs().max().item() <= 1e-6 * k * max(1.0, want.abs().max().item())
    rounded = kernels.gemv(x, w, bias)
    assert torch.equal(rounded, sums.to(dtype))  # the bf16 output is the fp32 sum rounded once
    for out, fp32_out in ((sums, True), (rounded, False)):
        alone = torch.cat([kernels.gemv(x[i : i + 1], w, bias, fp32_out=fp32_out) for i in range(rows)])
        assert torch.equal(out, alone)
        assert torch.equal(kernels.gemv(x, w, bias, fp32_out=fp32_out, packed=panels), out)
        assert torch.equal(kernels.gemv(x, w, bias, fp32_out=fp32_out, threads=1), out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_either_side_of_the_few_row_form_agree(kernels, dtype):
    """Unpacked, up to 16 rows skip the panel buffer (gemm_direct) and more pack per call: the same bits."""
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(33, 96, generator=gen).to(dtype), torch.randn(130, 96, generator=gen).to(dtype)
    whole = kernels.gemv(x, w)
    for rows in (1, 15, 16, 17, 33):
        assert torch.equal(kernels.gemv(x[:rows], w), whole[:rows])
        assert torch.equal(kernels.gemv(x[-rows:], w), whole[-rows:])


def test_panels_follow_in_place_weight_updates(kernels, model_dir):
    """The engine's packed copies (PanelWeight) are repacked when a weight changes in place, in a
    projection, in the LM head and in the one-call decode's plan; the output equals the unpacked GEMM's."""
    from transformers import AutoConfig

    from rlserve.model.linear import Projection
    from rlserve.model.loader import load_model
    from rlserve.model.shape import ModelShape

    shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))
    model = load_model(model_dir, shape, torch.float32, torch.device("cpu"))
    model.use_gemv(kernels)
    model.pack_panels()
    proj = next(m for m in model.modules() if isinstance(m, Projection))
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, proj.in_features, generator=gen)
    hidden = torch.randn(3, shape.hidden_size, generator=gen)
    for _ in range(2):
        assert torch.equal(proj(x), kernels.gemv(x, proj.weight, proj.bias))
        assert torch.equal(model.compute_logits(hidden), kernels.gemv(hidden, model.head_weight).float())
        with torch.no_grad():
            proj.weight.mul_(2)
            model.head_weight.add_(0.5)
    plan_panel = proj.panels.get(proj.weight)
    with torch.no_grad():
        proj.weight.mul_(-1)
    assert proj.panels.get(proj.weight).data_ptr() == plan_panel.data_ptr()  # repacked in its buffer
    assert torch.equal(proj(x), kernels.gemv(x, proj.weight, proj.bias))
