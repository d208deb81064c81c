"""Batch-invariant mode's GPU kernels (model/triton_kernels.py) against the trainer's patched model.

`exact_on(device, preset, dtype)` is shared by test_invariant_triton.py's CUDA tests (in process, on
the GPU) and its CPU tests, which run this file as a script in one process of their own under
TRITON_INTERPRET=1 (Triton reads it when the kernels are defined):
`python exact_triton.py kernels exact:DTYPE:MODEL_DIR ...` runs each case in turn and prints a line for each,
`ok CASE` or `failed CASE` (its traceback on stderr).
"""

from __future__ import annotations

import random
import sys
import traceback
import types

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.cpu_kernels import reference_paged_attention
from rlserve.model.invariant_ops import invariant_kernels
from rlserve.model.triton_kernels import TritonKernels
from rlserve.train import patch, token_logprobs, token_routed_experts


def exact_on(
    device: str, model_dir, dtype: str, prompts: int, max_tokens: int, alone: tuple[int, ...] | None = None
) -> None:
    """rlserve's engine in batch-invariant mode on `device` (16-token steps: chunked prefill beside
    decodes; shared prompt stems: prefix-cache hits; n = 2) and the patched transformers model on
    the same device give the same logprobs bit for bit, all sequences in one padded batch and each
    alone (those at the indices `alone`, or every one); for MoE the same routed experts."""
    cfg = Config()
    cfg.model.name, cfg.model.dtype, cfg.model.device = str(model_dir), dtype, device
    cfg.model.max_model_len = 256
    cfg.engine.kv_cache_bytes = 8 << 20
    cfg.engine.batch_invariant = True
    cfg.engine.max_num_batched_tokens = 16
    moe = AutoConfig.from_pretrained(model_dir).model_type == "qwen3_moe"
    cfg.enable_return_routed_experts = moe
    engine = Engine(cfg)
    assert isinstance(engine.runner.kernels, TritonKernels), type(engine.runner.kernels)
    rng = random.Random(7)
    vocab = engine.vocab_size
    stems = [[rng.randrange(vocab) for _ in range(n)] for n in (20, 9)]
    asked = [rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))] for _ in range(prompts)]
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    samples = [(out.prompt_token_ids, c) for out in engine.generate(asked, params) for c in out.outputs]

    model = patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device))
    prompt_ids = [p for p, _ in samples]
    completion_ids = [c.token_ids for _, c in samples]
    with torch.no_grad():
        padded = token_logprobs(model, prompt_ids, completion_ids, batch_size=len(samples))
        by_itself = range(len(samples)) if alone is None else {i % len(samples) for i in alone}
        for i, (p, c) in enumerate(samples):
            served = torch.tensor(c.logprobs, dtype=torch.float32)
            assert torch.equal(padded[i].cpu(), served), f"sequence {i} in the padded batch"
            if i in by_itself:
                single = token_logprobs(model, [p], [c.token_ids])[0].cpu()
                assert torch.equal(single, served), f"sequence {i} alone: max diff {(single - served).abs().max()}"
        if moe:
            experts = token_routed_experts(model, prompt_ids, completion_ids)
            for i, (_, c) in enumerate(samples):
                np.testing.assert_array_equal(experts[i].cpu().numpy(), c.routed_experts.astype(np.int64))


def kernels_match_torch(device: str) -> None:
    """Each Triton kernel against PyTorch's arithmetic (fp32 to rounding, bf16 to its precision), and
    invariant_kernels(device) hands them out with their row independence checked."""
    kernels = invariant_kernels(device)
    assert isinstance(kernels, TritonKernels), type(kernels)
    gen = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 0.07)):

        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=gen).to(dtype).to(device)

        x, w, b = randn(21, 70), randn(37, 70), randn(37)
        want = F.linear(x.float(), w.float(), b.float())
        torch.testing.assert_close(kernels.gemv(x, w, b).float(), want, atol=tol, rtol=0)
        torch.testing.assert_close(kernels.gemv(x, w, fp32_out=True), F.linear(x.float(), w.float()), atol=2e-5, rtol=0)
        hidden, delta, weight = randn(5, 96), randn(5, 96), randn(96)
        out = torch.empty_like(hidden)
        summed = (hidden.float() + delta.float()).to(dtype)
        kernels.add_rms_norm(hidden, delta, weight, out, 1e-6)
        assert torch.equal(hidden, summed)
        want = (F.rms_norm(summed.float(), (96,), eps=1e-6).to(dtype).float() * weight.float()).to(dtype)
        torch.testing.assert_close(out.float(), want.float(), atol=tol / 4, rtol=0)
        nh, nkv, d, t = 4, 2, 16, 6
        qkv, cos, sin, q_norm, k_norm = randn(t, (nh + 2 * nkv) * d), randn(t, 1, d), randn(t, 1, d), randn(d), randn(d)
        slots = torch.tensor([3, 0, 7, 9, 1, 2], device=device)
        k_cache, v_cache = randn(12, nkv, d) * 0, randn(12, nkv, d) * 0
        heads = qkv.view(t, nh + 2 * nkv, d).float()
        normed = torch.cat(
            (
                F.rms_norm(heads[:, :nh], (d,), q_norm.float()),
                F.rms_norm(heads[:, nh : nh + nkv], (d,), k_norm.float()),
            ),
            1,
        )
        rotated = normed * cos.float() + normed.roll(d // 2, dims=-1) * sin.float()
        kernels.qk_rope_store(qkv, cos, sin, q_norm, k_norm, 1e-6, slots, k_cache, v_cache, nh, nkv)
        got = qkv.view(t, nh + 2 * nkv, d)
        torch.testing.assert_close(got[:, : nh + nkv].float(), rotated, atol=tol, rtol=0)
        assert torch.equal(k_cache[slots], got[:, nh : nh + nkv]) and torch.equal(v_cache[slots], got[:, nh + nkv :])
        bs, q = 4, randn(5, nh, d)
        k_cache, v_cache = randn(48, nkv, d), randn(48, nkv, d)
        blocks = torch.tensor([[3, 7, 1], [5, 0, 0], [11, 2, 9], [3, 7, 1], [8, 0, 0]], device=device)
        lens = torch.tensor([10, 1, 12, 9, 3], device=device)
        want = reference_paged_attention(q.float().cpu(), k_cache.float().cpu(), v_cache.float().cpu(),
                                         blocks.cpu(), lens.cpu(), bs, 0.25)  # fmt: skip
        got = kernels.attention(q, k_cache, v_cache, blocks, lens, bs, 0.25).float().cpu()
        torch.testing.assert_close(got, want, atol=tol / 8, rtol=0)


def patch_the_language_once() -> None:
    """Triton's interpreter patches triton.language's builtins at every launch and undoes them after, and again,
    never undone, at every call of a jitted helper (tl.sum, tl.max, tl.cdiv, _round_to): ~1.5 ms of
    inspect.getmembers each, over 40,000 times in one `exact` run, most of its time. This process runs nothing but
    interpreted kernels, so the language is patched once and stays so. The kernels run as before: each patch
    wraps the same builtins the same way. A Triton whose interpreter differs is left as it is."""
    from triton.runtime import interpreter

    real = getattr(interpreter, "_patch_lang", None)
    if real is None or not hasattr(interpreter, "_LangPatchScope"):
        return
    patched: set[frozenset[int]] = set()

    class KeptPatches:
        def restore(self) -> None:
            pass

    def patch_once(fn):
        key = frozenset(id(v) for v in fn.__globals__.values() if isinstance(v, types.ModuleType))
        if key not in patched:
            real(fn)
            patched.add(key)
        return KeptPatches()

    interpreter._patch_lang = patch_once


def run_case(case: str) -> None:
    """`kernels`, or `exact:DTYPE:MODEL_DIR` on the interpreter: 3 prompts x n = 2, 4 tokens, the first and the
    last sequence alone beside the padded batch (the interpreter runs a program at a time in Python)."""
    if case == "kernels":
        kernels_match_torch("cpu")
    else:
        _, dtype, model_dir = case.split(":", 2)
        exact_on("cpu", model_dir, dtype, prompts=3, max_tokens=4, alone=(0, -1))


if __name__ == "__main__":
    # one process for every case: `kernels` first checks the kernels' row independence in each dtype, which
    # invariant_kernels keeps for the engines and trainers of the cases after it
    patch_the_language_once()
    for case in sys.argv[1:]:
        try:
            run_case(case)
        except Exception:
            traceback.print_exc()
            print(f"failed {case}", flush=True)
        else:
            print(f"ok {case}", flush=True)
