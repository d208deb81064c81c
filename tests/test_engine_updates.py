"""Weight updates, versions, pause modes and LoRA at the engine level, checked against transformers/PEFT."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from rlserve.engine.params import SamplingParams
from rlserve.engine.weights import WeightUpdateError, check_under_roots, stage_from_dir
from rlserve.model.lora import AdapterError, load_peft_adapter
from rlserve.model.make import make_model
from rlserve.runtime.inproc import AsyncEngine
from test_engine import assert_matches_hf, hf_logprobs, make_engine, random_prompts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return make_model("tiny", root / "base", seed=0), make_model("tiny", root / "next", seed=1)


def greedy_with_logprobs(engine, prompts, n=8):
    return engine.generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0))


def test_update_from_dir_swaps_weights_and_bumps_version(dirs):
    base, nxt = dirs
    engine = make_engine(base)
    prompts = random_prompts(3, engine.vocab_size, seed=20)
    before = greedy_with_logprobs(engine, prompts)
    assert before[0].outputs[0].policy_version == 0
    version = engine.commit_weights(stage_from_dir(engine.model, nxt), weight_version="step-1")
    assert version == 1 and engine.weight_version == "step-1"
    after = greedy_with_logprobs(engine, prompts)
    assert all(o.outputs[0].policy_version == 1 for o in after)
    assert [o.outputs[0].token_ids for o in after] != [o.outputs[0].token_ids for o in before]
    assert_matches_hf(AutoModelForCausalLM.from_pretrained(nxt, dtype=torch.float32).eval(), prompts, after)


def test_kv_from_old_weights_is_never_reused(dirs):
    base, nxt = dirs
    engine = make_engine(base)
    prompt = random_prompts(1, engine.vocab_size, lo=80, hi=80, seed=21)[0]
    greedy_with_logprobs(engine, [prompt])
    assert greedy_with_logprobs(engine, [prompt])[0].num_cached_tokens == 64
    engine.commit_weights(stage_from_dir(engine.model, nxt))
    out = greedy_with_logprobs(engine, [prompt])[0]
    assert out.num_cached_tokens == 0
    assert_matches_hf(AutoModelForCausalLM.from_pretrained(nxt, dtype=torch.float32).eval(), [prompt], [out])


@pytest.mark.parametrize("damage", ["shape", "extra", "missing", "truncated", "nan", "int"])
def test_bad_checkpoint_is_refused_and_old_weights_keep_serving(dirs, tmp_path, damage):
    base, nxt = dirs
    engine = make_engine(base)
    prompts = random_prompts(2, engine.vocab_size, seed=22)
    before = greedy_with_logprobs(engine, prompts)
    bad = tmp_path / "bad"
    shutil.copytree(nxt, bad)
    f = bad / "model.safetensors"
    tensors = load_file(f)
    name = "model.layers.1.mlp.up_proj.weight"
    if damage == "shape":
        tensors[name] = tensors[name][:-1]
    elif damage == "extra":
        tensors["model.layers.99.mlp.up_proj.weight"] = tensors[name].clone()
    elif damage == "missing":
        del tensors[name]
    elif damage == "nan":
        tensors[name][0, 0] = float("nan")
    elif damage == "int":
        tensors[name] = tensors[name].to(torch.int32)
    save_file(tensors, f)
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(WeightUpdateError):
        engine.commit_weights(stage_from_dir(engine.model, bad))
    assert engine.policy_version == 0
    after = greedy_with_logprobs(engine, prompts)
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]
    assert [o.outputs[0].logprobs for o in after] == [o.outputs[0].logprobs for o in before]


def test_weight_roots(tmp_path):
    inside = tmp_path / "ok" / "ckpt"
    inside.mkdir(parents=True)
    (tmp_path / "link").symlink_to("/etc")
    assert check_under_roots(str(inside), [str(tmp_path / "ok")]) == inside.resolve()
    with pytest.raises(PermissionError, match="weight roots"):
        check_under_roots(str(tmp_path / "ok" / ".." / "elsewhere"), [str(tmp_path / "ok")])
    with pytest.raises(PermissionError):
        check_under_roots(str(tmp_path / "link"), [str(tmp_path)])


def run_async(coro):
    return asyncio.run(coro)


async def collect(engine, prompt, params, rid):
    out = None
    async for out in engine.generate(prompt, params, rid):  # noqa: B007 (the last one is the answer)
        pass
    return out


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_update_during_generation_in_each_pause_mode(dirs, mode):
    base, nxt = dirs
    aeng = AsyncEngine(engine=make_engine(base))
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True, logprobs=0)
    prompts = random_prompts(4, aeng.vocab_size, seed=23)

    async def scenario():
        await aeng.pause("keep")  # the requests are mid-generation by construction: 5 steps in, 55 to go
        tasks = [asyncio.create_task(collect(aeng, p, params, f"r{i}")) for i, p in enumerate(prompts)]
        while await aeng.call(lambda e: len(e.scheduler.waiting)) < len(prompts):
            await asyncio.sleep(0.005)
        await aeng.resume(steps=5)
        assert await aeng.call(lambda e: e.generation_tokens) == 5 * len(prompts)
        aborted = await aeng.pause(mode)
        in_flight = await aeng.call(lambda e: e.scheduler.num_in_flight())
        version = await aeng.update_weights_from_dir(str(nxt), [str(nxt.parent)])
        late = asyncio.create_task(collect(aeng, prompts[0], params, "late"))  # queued while paused
        await asyncio.sleep(0.05)
        assert not late.done()
        await aeng.resume()
        outs = await asyncio.wait_for(asyncio.gather(*tasks, late), timeout=60)
        return aborted, in_flight, version, outs

    try:
        aborted, in_flight, version, outs = run_async(scenario())
    finally:
        aeng.shutdown()
    assert version == 1
    *first, late = outs
    assert late.outputs[0].version_spans[0].policy_version == 1 and len(late.outputs[0].token_ids) == 60
    for out in first:
        comp = out.outputs[0]
        assert len(comp.logprobs) == len(comp.token_ids)
        if mode == "keep":
            assert in_flight == 4 and comp.finish_reason == "length" and len(comp.token_ids) == 60
            spans = comp.version_spans
            assert [s.policy_version for s in spans] == [0, 1] and spans[0].end == spans[1].start and spans[1].end == 60
        elif mode == "abort":
            assert aborted == 4 and comp.finish_reason == "abort" and len(comp.token_ids) == 5
            assert [s.policy_version for s in comp.version_spans] == [0]
        else:
            assert in_flight == 0 and comp.finish_reason == "length" and len(comp.token_ids) == 60
            assert [s.policy_version for s in comp.version_spans] == [0]


@pytest.fixture(scope="module")
def adapters(dirs, tmp_path_factory):
    from peft import LoraConfig, get_peft_model

    base, _ = dirs
    out = []
    for i, targets in enumerate(
        [["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], ["q_proj", "v_proj"]]
    ):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        cfg = LoraConfig(r=4, lora_alpha=8 + 8 * i, target_modules=targets, init_lora_weights=False, use_rslora=bool(i))
        peft_model = get_peft_model(hf, cfg).eval()
        path = tmp_path_factory.mktemp(f"adapter{i}")
        peft_model.save_pretrained(path)
        out.append((path, peft_model))
    return out


def test_lora_logprobs_match_peft_and_mixed_batch_equals_alone(dirs, adapters):
    base, _ = dirs
    engine = make_engine(base)
    for i, (path, _) in enumerate(adapters):
        engine.add_adapter(load_peft_adapter(f"a{i}", path, engine.shape, engine.dtype, engine.device))
    assert engine.policy_version == 2
    prompts = random_prompts(3, engine.vocab_size, seed=24)
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, logprobs=0, seed=5)

    def run(prompt, adapter, rid):
        engine.add_request(rid, prompt, params, adapter=adapter)

    alone = {}
    for adapter in ["a0", "a1", None]:
        for j, prompt in enumerate(prompts):
            run(prompt, adapter, f"{adapter}-{j}")
            while engine.has_unfinished():
                for o in engine.step():
                    if o.finished:
                        alone[o.request_id] = o
    for i, (_, peft_model) in enumerate(adapters):
        for j, prompt in enumerate(prompts):
            comp = alone[f"a{i}-{j}"].outputs[0]
            ref = hf_logprobs(peft_model, prompt, comp.token_ids)
            want = ref.gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
            assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4)
    assert alone["a0-0"].outputs[0].token_ids != alone["None-0"].outputs[0].token_ids

    mixed = {}
    for j, prompt in enumerate(prompts):
        for adapter in ["a0", "a1", None]:
            run(prompt, adapter, f"{adapter}-{j}")
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                mixed[o.request_id] = o
    for rid, out in alone.items():
        assert mixed[rid].outputs[0].token_ids == out.outputs[0].token_ids
        assert torch.allclose(
            torch.tensor(mixed[rid].outputs[0].logprobs), torch.tensor(out.outputs[0].logprobs), atol=1e-5
        )


def test_bad_adapter_is_refused(dirs, adapters, tmp_path):
    base, _ = dirs
    engine = make_engine(base)
    path, _ = adapters[0]
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    tensors = load_file(bad / "adapter_model.safetensors")
    key = next(k for k in tensors if "lora_A" in k)
    tensors[key] = tensors[key][:, :-1].contiguous()
    save_file(tensors, bad / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match="expected A"):
        load_peft_adapter("bad", bad, engine.shape, engine.dtype, engine.device)
    with pytest.raises(FileNotFoundError):
        load_peft_adapter("none", tmp_path / "missing", engine.shape, engine.dtype, engine.device)
    with pytest.raises(ValueError, match="not loaded"):
        engine.add_request("x", [1, 2], SamplingParams(max_tokens=2), adapter="nope")
