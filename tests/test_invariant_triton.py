"""Batch-invariant mode on a GPU: rlserve's Triton kernels (model/triton_kernels.py) keep a row's bits
whatever its batch, and the engine and the patched trainer agree through them bit for bit.

On a CUDA machine the checks run on the GPU. Everywhere the kernels are compiled for Ampere and Hopper (Triton
ships its ptxas), and the checks run on CPU through Triton's interpreter (TRITON_INTERPRET=1), all in one
process of their own: the kernels' arithmetic against PyTorch's, their row independence, and the engine
(chunked prefill, prefix-cache hits, n = 2) against the patched transformers model, in fp32 and bf16, with
MoE's routed experts. The interpreter is not the GPU (its GEMM sums without tensor cores), so on CPU these
prove the kernels' logic and the engine's and trainer's wiring; the GPU run proves the bits on the card.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import make_variant
from exact_triton import exact_on, kernels_match_torch
from rlserve.model.make import make_model
from rlserve.model.moe import sum_by_expert_id
from rlserve.model.triton_kernels import LAUNCH

triton = pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("exact_triton.py")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


class Interpreted:
    """exact_triton.py's cases run once, in one process under TRITON_INTERPRET=1, and each case's outcome."""

    def __init__(self, cases: list[str]):
        env = {**os.environ, "TRITON_INTERPRET": "1"}
        run = subprocess.run([sys.executable, str(SCRIPT), *cases], env=env, capture_output=True, text=True,
                             timeout=1800)  # fmt: skip
        self.lines, self.output = run.stdout.splitlines(), run.stdout[-2000:] + run.stderr[-6000:]

    def check(self, case: str) -> None:
        assert f"ok {case}" in self.lines, self.output


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


# The interpreter runs a program at a time in Python: its runs take the presets with two layers (the MoE one a
# sparse layer and a dense one), which wire the engine and the trainer as four do, in half the time.
@pytest.fixture(scope="module")
def interpreted(tmp_path_factory) -> tuple[Interpreted, dict[str, str]]:
    models = tmp_path_factory.mktemp("models")
    dense = make_variant("tiny", models / "tiny-2-layers", num_hidden_layers=2)
    moe = make_variant("tiny-moe", models / "tiny-moe-2-layers", num_hidden_layers=2, mlp_only_layers=[1])
    cases = {"kernels": "kernels", "float32": f"exact:float32:{dense}", "bfloat16": f"exact:bfloat16:{dense}",
             "moe": f"exact:float32:{moe}"}  # fmt: skip
    return Interpreted(list(cases.values())), cases


def test_kernels_match_torch_and_keep_rows_independent_interpreted(interpreted):
    run, cases = interpreted
    run.check(cases["kernels"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_patched_trainer_agree_bitwise_interpreted(interpreted, dtype):
    run, cases = interpreted
    run.check(cases[dtype])


def test_moe_logprobs_and_routed_experts_agree_interpreted(interpreted):
    run, cases = interpreted
    run.check(cases["moe"])


def gpu_kernels(dtype: str):
    """(kernel, signature, constants) of each kernel at a Qwen3-like shape (head_dim 128, 4 query heads a KV head)."""
    from rlserve.model import triton_kernels as tk

    t = f"*{dtype}"
    gemm = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "DOT": "mma"} if dtype == "bf16" else {
        "BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 32, "DOT": "ieee"}  # fmt: skip
    return [
        (tk._gemm_rows, {"x": t, "w": t, "bias": t, "out": t, "rows": "i32", "n": "i32", "k": "i32"},
         {**gemm, "HAS_BIAS": True}),
        (tk._add_rms_norm_rows, {"hidden": t, "delta": t, "weight": t, "out": t, "dim": "i32", "eps": "fp32"},
         {"HAS_DELTA": True, "BLOCK": 1024}),
        (tk._qk_rope_store_rows, {"qkv": t, "cos": t, "sin_signed": t, "q_norm": t, "k_norm": t, "eps": "fp32",
         "slots": "*i64", "k_cache": t, "v_cache": t, "num_heads": "i32", "num_kv_heads": "i32"},
         {"D": 128, "BLOCK_D": 128, "BLOCK_H": 64, "HAS_NORM": True}),
        (tk._paged_attention_rows, {"q": t, "q_row_stride": "i32", "k_cache": t, "v_cache": t, "blocks": "*i64",
         "ctx_lens": "*i64", "out": t, "width": "i32", "num_heads": "i32", "num_kv_heads": "i32", "scale": "fp32"},
         {"D": 128, "BLOCK_D": 128, "GROUP": 4, "BLOCK_G": 4, "BLOCK_SIZE": 16, "BLOCK_S": 16}),
    ]  # fmt: skip


@pytest.mark.parametrize("arch", [80, 90], ids=["ampere", "hopper"])
def test_kernels_compile_for_the_gpu(arch, tmp_path, monkeypatch):
    """Every kernel compiles to a cubin with Triton's own ptxas, no GPU needed: the bf16 GEMM on tensor
    cores, the fp32 GEMM with IEEE FMAs and no tensor-core instruction (no TF32)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    for dtype in ("fp32", "bf16"):
        for kernel, signature, constants in gpu_kernels(dtype):
            source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
            compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options=LAUNCH)
            assert compiled.asm["cubin"], kernel
            if kernel.__name__ == "_gemm_rows":
                assert ("mma" in compiled.asm["ptx"]) == (dtype == "bf16"), (dtype, arch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_sums_without_atomics_equal_index_add(dtype):
    """The GPU's MoE combine (no atomics) adds each token's experts in the order CPU's index_add_ does."""
    gen = torch.Generator().manual_seed(0)
    tokens, top_k, hidden, num_experts = 9, 3, 16, 8
    experts = torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(tokens)])
    order = experts.view(-1).argsort(stable=True)
    out = torch.randn(tokens * top_k, hidden, generator=gen).to(dtype)
    x = torch.zeros(tokens, hidden, dtype=dtype)
    want = torch.zeros_like(x).index_add_(0, order // top_k, out)
    assert torch.equal(sum_by_expert_id(out, x, order, experts), want)


@pytest.mark.cuda
@cuda
def test_kernels_match_torch_and_keep_rows_independent_on_the_gpu():
    kernels_match_torch("cuda")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_and_patched_trainer_agree_bitwise_on_the_gpu(model_dir, moe_dir, dtype):
    exact_on("cuda", model_dir, dtype, prompts=24, max_tokens=16)
    exact_on("cuda", moe_dir, dtype, prompts=8, max_tokens=8)
