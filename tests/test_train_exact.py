"""True on-policy: rlserve.train's patched transformers model scores rlserve's completions bit for bit.

Real `rlserve serve` processes in batch-invariant mode sample under concurrent load (mixed prompt lengths,
shared prefixes, n > 1, chunked prefill); the patched model's logprobs equal the sampler's with
`torch.equal`, for each sequence alone, in one padded batch and packed, in float32 and bfloat16, and
again after an optimizer step pushed to the server.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from conftest import start_server, stop_server
from rlserve.client import InferenceClient
from rlserve.model.make import make_model
from rlserve.train import PatchRefused, patch, token_logprobs, token_routed_experts
from test_pd import metric

NUM_COMPLETIONS = 200


def server_args(model_dir, dtype: str, root) -> tuple[str, ...]:
    return (
        "--model.name", str(model_dir), "--model.dtype", dtype, "--engine.batch_invariant", "true",
        "--engine.max_num_batched_tokens", "64",  # long prompts prefill in chunks beside decodes
        "--weight_roots", json.dumps([str(root)]),
    )  # fmt: skip


async def rollouts(url: str, vocab: int, rng: random.Random, count: int):
    """At least `count` completions from concurrent requests: prompts of 1-90 tokens, a third of them on
    shared stems (prefix-cache hits), n of 1, 2 or 4, 1-24 tokens each, seeded sampling at temperature 1."""
    stems = [[rng.randrange(vocab) for _ in range(rng.choice((8, 20, 40)))] for _ in range(3)]
    calls = []
    total = 0
    while total < count:
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 50))]
        if rng.random() < 0.35:
            prompt = rng.choice(stems) + prompt[: rng.randint(1, 10)]
        n = rng.choice((1, 1, 2, 4))
        calls.append((prompt, n, rng.randint(1, 24), rng.randrange(1 << 30)))
        total += n
    async with InferenceClient(url) as client:
        groups = await asyncio.gather(
            *(
                client.generate_group(token_ids=p, n=n, max_tokens=m, seed=s, return_text=False,
                                      sampling_params={"ignore_eos": True})
                for p, n, m, s in calls
            )
        )  # fmt: skip
    return [sample for group in groups for sample in group]


def assert_bitwise(model, samples) -> None:
    prompts = [s.prompt_ids for s in samples]
    completions = [s.completion_ids for s in samples]
    served = [torch.tensor(s.logprobs, dtype=torch.float32) for s in samples]
    with torch.no_grad():
        alone = [token_logprobs(model, [p], [c])[0] for p, c in zip(prompts, completions)]
        padded = token_logprobs(model, prompts, completions, batch_size=len(samples))
        packed = token_logprobs(model, prompts, completions, batch_size=16, packed=True)
    for i, want in enumerate(served):
        assert len(want) == len(completions[i]) > 0
        assert torch.equal(alone[i], want), f"sequence {i} alone: max diff {(alone[i] - want).abs().max()}"
        assert torch.equal(padded[i], want), f"sequence {i} in the padded batch"
        assert torch.equal(packed[i], want), f"sequence {i} packed"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_patched_trainer_equals_sampler_bitwise_and_after_a_weight_update(model_dir, root, dtype):
    torch_dtype = getattr(torch, dtype)
    url, proc = start_server(*server_args(model_dir, dtype, root))
    try:
        model = patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype))
        vocab = model.config.vocab_size
        rng = random.Random(44)
        samples = asyncio.run(rollouts(url, vocab, rng, NUM_COMPLETIONS))
        assert len(samples) >= NUM_COMPLETIONS
        assert {s.policy_version for s in samples} == {0}
        assert_bitwise(model, samples)

        # one policy-gradient step on the patched model, its weights pushed to the server
        before = [s.logprobs for s in samples[:8]]
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
        lps = token_logprobs(model, [s.prompt_ids for s in samples[:32]], [s.completion_ids for s in samples[:32]])
        advantages = torch.tensor([rng.choice((-1.0, 1.0)) for _ in lps])
        loss = -sum(a * lp.sum() for a, lp in zip(advantages, lps)) / len(lps)
        loss.backward()
        optimizer.step()
        step_dir = root / f"step1-{dtype}"
        model.save_pretrained(step_dir)
        with torch.no_grad():
            rescored = token_logprobs(
                model, [s.prompt_ids for s in samples[:8]], [s.completion_ids for s in samples[:8]]
            )
        assert any(r.tolist() != b for r, b in zip(rescored, before)), "the step changed nothing"

        async def push_and_roll():
            async with InferenceClient(url) as client:
                versions = await client.update_weights(str(step_dir))
            return versions, await rollouts(url, vocab, random.Random(45), 60)

        versions, after = asyncio.run(push_and_roll())
        assert list(versions.values()) == [1]
        assert {s.policy_version for s in after} == {1}
        assert_bitwise(model, after)
    finally:
        stop_server(proc)


def test_patch_refuses_what_it_cannot_make_exact(model_dir):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with pytest.raises(PatchRefused, match="float32 or all bfloat16"):
        patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float16))
    model.model.norm.weight.data = model.model.norm.weight.data.to(torch.bfloat16)
    with pytest.raises(PatchRefused, match="must all be float32 or all bfloat16"):
        patch(model)
    cfg = AutoConfig.from_pretrained(model_dir)
    cfg.use_sliding_window = True
    with pytest.raises(PatchRefused, match="sliding-window"):
        patch(AutoModelForCausalLM.from_config(cfg))
    cfg = AutoConfig.for_model("gpt2", n_layer=1, n_embd=16, n_head=2, vocab_size=64)
    with pytest.raises(PatchRefused, match="gpt2"):
        patch(AutoModelForCausalLM.from_config(cfg))
    with pytest.raises(PatchRefused, match="lm_head_dtype"):
        patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), lm_head_dtype="bfloat16")
    with pytest.raises(PatchRefused, match="on CPU and on one CUDA device"):
        patch(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to("meta"))


def test_patched_forward_keeps_names_and_gradients(model_dir):
    """Parameter names unchanged; the patched logprobs' gradient is the unpatched model's (same function)."""
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    names = [n for n, _ in model.named_parameters()]
    patch(model)
    assert [n for n, _ in model.named_parameters()] == names
    prompts, completions = [[5, 6, 7], [9, 10, 11, 12, 13]], [[20, 21, 22, 23], [30, 31]]
    sum(lp.sum() for lp in token_logprobs(reference, prompts, completions)).backward()
    expected = [q.grad for q in reference.parameters()]

    def completion_logprobs_through_forward():
        """The patched forward called as transformers' (all rows' logits), a loss over the completions."""
        ids = torch.tensor([[5, 6, 7, 20, 21, 22, 23], [9, 10, 11, 12, 13, 30, 31]])
        logp = torch.log_softmax(model(input_ids=ids).logits, -1)
        return sum(
            logp[row, len(p) - 1 + j, t]
            for row, (p, c) in enumerate(zip(prompts, completions))
            for j, t in enumerate(c)
        )

    for loss in (
        lambda: sum(lp.sum() for lp in token_logprobs(model, prompts, completions)),
        lambda: sum(lp.sum() for lp in token_logprobs(model, prompts, completions, packed=True)),
        completion_logprobs_through_forward,
    ):
        model.zero_grad(set_to_none=True)
        loss().backward()
        for (name, p), q in zip(model.named_parameters(), expected):
            assert p.grad is not None and (p.grad - q).norm() <= 1e-4 * q.norm(), name


def decode_experts(payload: dict) -> torch.Tensor:
    raw = np.frombuffer(
        base64.b64decode(payload["data"]), dtype="<" + {"uint8": "u1", "uint16": "u2"}[payload["dtype"]]
    )
    return torch.from_numpy(raw.reshape(payload["shape"]).astype(np.int64))


# two engines' ranks holding the experts, with the load balancer re-placing them every 4 steps (2 slots for replicas of
# hot experts) and dual-batch overlap: none of it may change a bit
EXPERT_PARALLEL = ("--parallel.dp", "2", "--parallel.enable_expert_parallel", "true", "--parallel.enable_eplb", "true",
                   "--parallel.eplb_step_interval", "4", "--parallel.eplb_num_redundant_experts", "2",
                   "--parallel.enable_dbo", "true")  # fmt: skip


@pytest.mark.parametrize(
    "dtype,parallel", [("float32", ()), ("bfloat16", ()), ("float32", EXPERT_PARALLEL)], ids=["fp32", "bf16", "ep"]
)
def test_qwen3_moe_logprobs_and_routed_experts_equal(tmp_path_factory, dtype, parallel):
    """Batch-invariant mode covers Qwen3-MoE (the experts' rows through the GEMV): under concurrent load
    with chunked prefill the patched model's logprobs and routed experts equal the server's. So does it with
    the experts spread over two data-parallel engines (expert parallelism): each engine's tokens go to the
    other's experts and back, in batches that follow both engines' loads, and come back with one rank's bits,
    while the load balancer moves and replicates experts."""
    moe_dir = make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")
    url, proc = start_server(
        "--model.name", str(moe_dir), "--model.dtype", dtype, "--engine.batch_invariant", "true",
        "--engine.max_num_batched_tokens", "32", "--enable_return_routed_experts", *parallel,
    )  # fmt: skip
    try:
        rng = random.Random(3)
        stem = [rng.randrange(2000) for _ in range(24)]
        bodies = []
        for i in range(16):
            prompt = (stem if i % 3 == 0 else []) + [rng.randrange(2000) for _ in range(rng.randint(1, 40))]
            params = {"temperature": 1.0, "max_tokens": rng.randint(1, 16), "n": rng.choice((1, 2)),
                      "seed": i, "logprobs": 0, "ignore_eos": True}  # fmt: skip
            bodies.append({"token_ids": prompt, "sampling_params": params})

        async def run_all():
            async with httpx.AsyncClient(timeout=300) as http:
                return await asyncio.gather(*(http.post(f"{url}/inference/v1/generate", json=b) for b in bodies))

        prompts, completions, served, experts = [], [], [], []
        for body, r in zip(bodies, asyncio.run(run_all())):
            assert r.status_code == 200, r.text
            for choice in r.json()["choices"]:
                prompts.append(body["token_ids"])
                completions.append(choice["token_ids"])
                served.append(torch.tensor([e["logprob"] for e in choice["logprobs"]["content"]], dtype=torch.float32))
                experts.append(decode_experts(choice["routed_experts"]))
        model = patch(AutoModelForCausalLM.from_pretrained(moe_dir, dtype=getattr(torch, dtype)))
        with torch.no_grad():
            padded = token_logprobs(model, prompts, completions)
            alone = [token_logprobs(model, [p], [c])[0] for p, c in zip(prompts, completions)]
        routed = token_routed_experts(model, prompts, completions)
        for i in range(len(prompts)):
            assert torch.equal(padded[i], served[i]) and torch.equal(alone[i], served[i]), f"sequence {i}"
            assert torch.equal(routed[i], experts[i]), f"sequence {i}: routed experts"
        if parallel:  # tokens crossed between the engines, whose experts were re-placed
            assert metric(url, "rlserve:ep_all_to_alls_total") > 0 and metric(url, "rlserve:eplb_rebalances_total") > 0
        lps = token_logprobs(model, prompts[:4], completions[:4])  # the gradient flows through the experts too
        sum(lp.sum() for lp in lps).backward()
        assert model.model.layers[0].mlp.experts.gate_up_proj.grad.abs().sum() > 0
    finally:
        stop_server(proc)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_llama_and_qwen2_shapes_equal(model_dir, tmp_path, family):
    """The same guarantee for a Llama shape (untied LM head, SmolLM's family) and a Qwen2 shape (qkv bias),
    random weights with the tiny model's tokenizer, bf16 (the emulated dtype on AVX2)."""
    import shutil

    cfg = AutoConfig.for_model(
        family, vocab_size=2048, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=False, eos_token_id=2043, bos_token_id=2041, pad_token_id=2041,
    )  # fmt: skip
    torch.manual_seed(0)
    made = tmp_path / family
    AutoModelForCausalLM.from_config(cfg).save_pretrained(made)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).exists():
            shutil.copy(model_dir / name, made / name)
    url, proc = start_server(*server_args(made, "bfloat16", tmp_path))
    try:
        samples = asyncio.run(rollouts(url, 2048, random.Random(7), 40))
        assert_bitwise(patch(AutoModelForCausalLM.from_pretrained(made, dtype=torch.bfloat16)), samples)
    finally:
        stop_server(proc)
