"""Cascade decode attention: sequences sharing leading KV blocks attend to them once, together.

The split is the decode path when the C attention kernel is off or cannot be built, so these
engines turn the kernel off."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlserve.engine.params import SamplingParams
from rlserve.model.llama import Attention
from test_engine import hf_logprobs, random_prompts
from test_engine import make_engine as make_any_engine


def make_engine(model_dir, **engine):
    return make_any_engine(model_dir, cpu_kernels=False, **engine)


@pytest.fixture
def cascade_calls(monkeypatch):
    calls = []
    original = Attention._decode_cascade

    def counted(self, q, plan, *args):
        calls.append((plan.num_grouped, plan.query_rows is not None, plan.prefix_mask is not None))
        return original(self, q, plan, *args)

    monkeypatch.setattr(Attention, "_decode_cascade", counted)
    return calls


def workload(vocab: int):
    """Groups of unequal size and prefix length (padding on both axes), a singleton, and a second
    request that shares the first prompt's cached blocks but continues differently."""
    prompts = [random_prompts(1, vocab, lo=n, hi=n, seed=n)[0] for n in (40, 64, 17, 100)]
    prompts.append(prompts[1][:48] + random_prompts(1, vocab, lo=10, hi=10, seed=99)[0])
    params = [
        SamplingParams(n=n, temperature=1.0, max_tokens=40, ignore_eos=True, logprobs=0, seed=i)
        for i, n in enumerate((4, 8, 3, 1, 2))
    ]
    return prompts, params


def run(engine, prompts, params):
    # the first four together; the fifth arrives once the first prompt's blocks are cached
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params[i])
    outs = {}
    steps = 0
    while engine.has_unfinished() or "r4" not in outs:
        if steps == 3:
            engine.add_request("r4", prompts[4], params[4])
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
        steps += 1
    return [outs[f"r{i}"] for i in range(5)]


def test_cascade_logprobs_match_the_forward_pass(model_dir, hf, cascade_calls):
    engine = make_engine(model_dir)
    prompts, params = workload(engine.vocab_size)
    outs = run(engine, prompts, params)
    assert outs[4].num_cached_tokens == 48  # shares three full blocks with the n=8 request
    # the split ran, with ragged groups and prefixes of different lengths among its plans
    assert cascade_calls and any(padded for _, padded, _ in cascade_calls)
    assert any(masked for _, _, masked in cascade_calls)
    for prompt, out in zip(prompts, outs):
        for comp in out.outputs:
            want = (
                hf_logprobs(hf, prompt, comp.token_ids).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
            )
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4), (
                (torch.tensor(comp.logprobs) - want).abs().max()
            )


def test_cascade_gives_the_tokens_of_plain_decode(model_dir, cascade_calls):
    prompts, params = workload(2048)
    plain = run(make_engine(model_dir, cascade_attention=False), prompts, params)
    assert not cascade_calls
    split = run(make_engine(model_dir), prompts, params)
    assert cascade_calls
    calls = len(cascade_calls)
    kernel = run(make_any_engine(model_dir), prompts, params)  # the C kernel's engine never splits
    assert len(cascade_calls) == calls
    for a, b, c in zip(plain, split, kernel):
        assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs] == [o.token_ids for o in c.outputs]
        for x, y, z in zip(a.outputs, b.outputs, c.outputs):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=1e-4)
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(z.logprobs), atol=1e-4)


def test_reordered_rows_keep_their_adapters(model_dir, hf, tmp_path, cascade_calls):
    """Grouped rows move to the front of the batch; LoRA row groups must follow them."""
    from peft import LoraConfig, get_peft_model

    from rlserve.model.lora import load_peft_adapter

    torch.manual_seed(3)
    cfg = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), cfg).eval()
    peft_model.save_pretrained(tmp_path / "adapter")
    engine = make_engine(model_dir)
    engine.add_adapter(load_peft_adapter("a", tmp_path / "adapter", engine.shape, engine.dtype, engine.device))
    prompts = random_prompts(3, engine.vocab_size, lo=20, hi=40, seed=31)
    # a singleton first, so the groups behind it are moved ahead of it
    requests = [(prompts[0], 1, "a"), (prompts[1], 4, "a"), (prompts[2], 3, None)]
    for i, (prompt, n, adapter) in enumerate(requests):
        params = SamplingParams(n=n, temperature=1.0, max_tokens=12, ignore_eos=True, logprobs=0, seed=i)
        engine.add_request(str(i), prompt, params, adapter=adapter)
    outs = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert cascade_calls
    for i, (prompt, _, adapter) in enumerate(requests):
        reference = peft_model if adapter else hf
        for comp in outs[str(i)].outputs:
            want = (
                hf_logprobs(reference, prompt, comp.token_ids)
                .gather(1, torch.tensor(comp.token_ids).unsqueeze(1))
                .squeeze(1)
            )
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4)
