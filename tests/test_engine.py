"""The engine against transformers' forward pass, on the embedded tiny model."""

from __future__ import annotations

import random

import pytest
import torch

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams


def make_engine(model_dir, **engine) -> Engine:
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = engine.pop("max_model_len", 1024)
    cfg.engine.kv_cache_bytes = engine.pop("kv_cache_bytes", 32 << 20)
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    return Engine(cfg)


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def random_prompts(count: int, vocab: int, lo: int = 3, hi: int = 40, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(count)]


def hf_logprobs(hf, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log_softmax(logits / T) at each completion position, from one plain forward pass."""
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + completion])).logits[0].float()
    start = len(prompt) - 1
    return torch.log_softmax(logits[start : start + len(completion)] / temperature, dim=-1)


def assert_matches_hf(hf, prompts, outs, atol: float = 1e-4):
    """Greedy tokens equal transformers `generate`; logprobs equal its forward pass (to `atol`)."""
    for prompt, out in zip(prompts, outs):
        comp = out.outputs[0]
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=len(comp.token_ids),
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        assert comp.token_ids == ref[0, len(prompt) :].tolist()
        lp = hf_logprobs(hf, prompt, comp.token_ids).gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(comp.logprobs), lp, atol=atol)


def test_greedy_matches_transformers_generate(engine, hf):
    prompts = random_prompts(6, engine.vocab_size) + [engine.tokenizer.encode("Hello, my name is")]
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        assert out.outputs[0].token_ids == ref
        assert out.outputs[0].finish_reason == "length"


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_match_forward_pass(engine, hf, temperature):
    prompts = random_prompts(5, engine.vocab_size, seed=1)
    params = SamplingParams(
        temperature=temperature, max_tokens=20, ignore_eos=True, logprobs=3, seed=7, logprobs_mode="processed_logprobs"
    )
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        comp = out.outputs[0]
        ref = hf_logprobs(hf, prompt, comp.token_ids, temperature)
        got = torch.tensor(comp.logprobs)
        want = ref.gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
        assert len(comp.logprobs) == len(comp.token_ids)
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
        for pos, top in enumerate(comp.top_logprobs):
            vals, ids = ref[pos].topk(3)
            assert list(top) == ids.tolist()
            assert torch.allclose(torch.tensor(list(top.values())), vals, atol=1e-4)


@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (-1, 0.6), (20, 0.8)])
def test_processed_logprobs_are_the_renormalised_filtered_distribution(engine, hf, top_k, top_p):
    prompts = random_prompts(4, engine.vocab_size, seed=2)
    t = 0.9
    params = SamplingParams(
        temperature=t,
        top_k=top_k,
        top_p=top_p,
        max_tokens=12,
        ignore_eos=True,
        logprobs=0,
        seed=3,
        logprobs_mode="processed_logprobs",
    )
    for prompt, out in zip(prompts, engine.generate(prompts, params)):
        comp = out.outputs[0]
        scaled = hf_logprobs(hf, prompt, comp.token_ids, t)  # log_softmax(logits / T): same order as logits / T
        for pos, token in enumerate(comp.token_ids):
            row = scaled[pos].clone()
            if top_k > 0:
                row[row < row.topk(top_k).values[-1]] = float("-inf")
            if top_p < 1:
                probs = row.softmax(-1)
                sorted_p, order = probs.sort(descending=True)
                ahead = sorted_p.cumsum(0) - sorted_p
                drop = torch.zeros_like(probs, dtype=torch.bool)
                drop[order[ahead >= top_p]] = True
                row[drop] = float("-inf")
            want = torch.log_softmax(row, -1)[token]
            assert want.item() > float("-inf"), "sampled a token outside the kept set"
            assert abs(comp.logprobs[pos] - want.item()) < 1e-4


def test_raw_logprobs_mode_ignores_temperature(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, seed=4)[0]
    params = SamplingParams(
        temperature=0.5, top_k=3, max_tokens=8, ignore_eos=True, logprobs=0, seed=1, logprobs_mode="raw"
    )
    comp = engine.generate([prompt], params)[0].outputs[0]
    ref = hf_logprobs(hf, prompt, comp.token_ids, 1.0)
    want = ref.gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4)


def test_default_logprobs_are_raw_and_logits_modes_skip_log_softmax(engine, hf):
    # vLLM's default (raw_logprobs) and its *_logits modes: the values before log_softmax, processed = / T
    prompt = random_prompts(1, engine.vocab_size, seed=19)[0]
    base = {"temperature": 0.5, "max_tokens": 6, "ignore_eos": True, "logprobs": 2, "seed": 1}
    for mode, scale, normalise in (
        (None, 1.0, True),
        ("raw_logits", 1.0, False),
        ("processed_logits", 0.5, False),
    ):
        comp = engine.generate([prompt], SamplingParams(**base, logprobs_mode=mode))[0].outputs[0]
        with torch.no_grad():
            rows = hf(torch.tensor([prompt + comp.token_ids])).logits[0].float()[len(prompt) - 1 : -1] / scale
        ref = torch.log_softmax(rows, -1) if normalise else rows
        want = ref.gather(1, torch.tensor(comp.token_ids).unsqueeze(1)).squeeze(1)
        assert torch.allclose(torch.tensor(comp.logprobs), want, atol=1e-4), mode
        best = {int(i): float(v) for v, i in zip(*ref[0].topk(2))}
        assert all(abs(comp.top_logprobs[0][i] - v) < 1e-4 for i, v in best.items()), mode


def test_seeded_request_is_batch_invariant(engine):
    target = random_prompts(1, engine.vocab_size, seed=5)[0]
    params = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, logprobs=0, seed=1234)
    alone = engine.generate([target], params)[0].outputs[0]
    others = random_prompts(31, engine.vocab_size, lo=5, hi=120, seed=6)
    mixed = [
        SamplingParams(temperature=0.8, max_tokens=random.Random(i).randint(5, 40), ignore_eos=True) for i in range(31)
    ]
    outs = engine.generate(others[:15] + [target] + others[15:], mixed[:15] + [params] + mixed[15:])
    together = outs[15].outputs[0]
    assert together.token_ids == alone.token_ids
    assert torch.allclose(torch.tensor(together.logprobs), torch.tensor(alone.logprobs), atol=1e-5)


def test_n_samples_share_the_prompt_computed_once(model_dir):
    prompt = random_prompts(1, 2048, lo=256, hi=256, seed=8)[0]
    params = SamplingParams(n=8, temperature=1.0, max_tokens=16, ignore_eos=True, logprobs=0, seed=11)
    cached = make_engine(model_dir)
    out = cached.generate([prompt], params)[0]
    stats = cached.stats
    # 16 full blocks of 16 tokens: computed by one sample, shared by the other seven
    assert stats.prompt_tokens_computed == 256
    assert len(out.outputs) == 8 and len({tuple(o.token_ids) for o in out.outputs}) > 1
    # a second request for the same prompt is served from the prefix cache (all but the last block)
    again = cached.generate([prompt], params)[0]
    assert again.num_cached_tokens == 240
    assert cached.stats.prompt_tokens_computed == 256 + 16
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]

    uncached = make_engine(model_dir, enable_prefix_caching=False)
    ref = uncached.generate([prompt], params)[0]
    assert [o.token_ids for o in ref.outputs] == [o.token_ids for o in out.outputs]
    for a, b in zip(ref.outputs, out.outputs):
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_prefix_cache_respects_salt(model_dir):
    eng = make_engine(model_dir)
    prompt = random_prompts(1, 2048, lo=64, hi=64, seed=9)[0]
    p = SamplingParams(temperature=0, max_tokens=2)
    for salt, expect_cached in [(None, 0), (None, 48), ("a", 0), ("a", 48), ("b", 0)]:
        eng.add_request("r", prompt, p, cache_salt=salt)
        while eng.has_unfinished():
            outs = eng.step()
        assert outs[-1].num_cached_tokens == expect_cached, salt


def test_preemption_gives_same_outputs_as_unconstrained(model_dir):
    prompts = random_prompts(12, 2048, lo=20, hi=60, seed=10)
    params = [
        SamplingParams(temperature=0 if i % 2 else 1.0, max_tokens=40, ignore_eos=True, logprobs=0, seed=i)
        for i in range(len(prompts))
    ]
    roomy = make_engine(model_dir, max_model_len=128).generate(prompts, params)
    # 8 blocks of 16 tokens: room for one full-length sequence, so requests must take turns
    tight = make_engine(model_dir, max_model_len=128, kv_cache_bytes=8 * 16 * 2048)
    assert tight.pool.num_blocks == 8
    outs = tight.generate(prompts, params)
    assert tight.stats.num_preemptions > 0
    for a, b in zip(roomy, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-4)


@pytest.mark.parametrize(
    "prompt,kwargs,field",
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([1, 2, 99999], {}, "prompt token id"),
        ([1, -1], {}, "prompt token id"),
        ([1] * 1024, {}, "maximum context length"),
        ([1, 2], {"max_tokens": 0}, "max_tokens"),
        ([1, 2], {"top_p": 0.0}, "top_p"),
        ([1, 2], {"top_p": 1.5}, "top_p"),
        ([1, 2], {"temperature": -0.1}, "temperature"),
        ([1, 2], {"stop": 7}, "stop"),
        ([1, 2], {"stop": [None]}, "stop"),
        ([1, 2], {"top_k": -5}, "top_k"),
        ([1, 2], {"n": 0}, "n"),
        ([1, 2], {"stop_token_ids": [99999]}, "stop_token_ids"),
        ([1, 2], {"logprobs": 1000}, "logprobs"),
    ],
)
def test_bad_input_raises_and_engine_keeps_serving(engine, prompt, kwargs, field):
    engine.add_request("good", [5, 6, 7], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    with pytest.raises(ValueError, match=field):
        engine.add_request("bad", prompt, SamplingParams(**{"max_tokens": 4, **kwargs}))
    finished = []
    while engine.has_unfinished():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["good"]
    assert len(finished[0].outputs[0].token_ids) == 6


def test_stop_conditions(engine):
    prompt = random_prompts(1, engine.vocab_size, seed=12)[0]
    free = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))[0].outputs[0]
    ids = free.token_ids
    # stop token: generation ends on it and keeps it in token_ids
    stop_id = ids[5]
    first = ids.index(stop_id)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id]))[0].outputs[
        0
    ]
    assert out.token_ids == ids[: first + 1] and out.finish_reason == "stop" and out.stop_reason == stop_id
    # min_tokens masks the stop token until reached
    out = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[stop_id], min_tokens=first + 3)
    )[0].outputs[0]
    assert len(out.token_ids) >= first + 3 and stop_id not in out.token_ids[: first + 3]
    # stop string: cut from the text, not from the tokens
    text = free.text
    needle = text[len(text) // 2 : len(text) // 2 + 3]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=needle))[
        0
    ].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == needle
    assert out.text == text[: text.index(needle)]
    kept = engine.generate(
        [prompt],
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=needle, include_stop_str_in_output=True),
    )[0].outputs[0]
    assert kept.text == text[: text.index(needle) + len(needle)]
    # max_tokens
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0].outputs[0]
    assert out.token_ids == ids[:3] and out.finish_reason == "length" and out.stop_reason is None


def test_eos_finishes_unless_ignored(model_dir):
    eng = make_engine(model_dir)
    assert eng.tokenizer.convert_tokens_to_ids("<|im_end|>") in eng.eos_token_ids
    prompt = random_prompts(1, eng.vocab_size, seed=16)[0]
    free = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    # random weights never choose EOS on their own: declare a token greedy decoding emits to be one
    eos = free.token_ids[4]
    eng.eos_token_ids = frozenset({eos})
    out = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    first = free.token_ids.index(eos)
    assert out.token_ids == free.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason is None
    ignored = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == free.token_ids and ignored.finish_reason == "length"
    held = eng.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=first + 2))[0].outputs[0]
    assert eos not in held.token_ids[: first + 2]


def test_incremental_text_equals_full_decode_and_never_splits_characters(engine):
    tok = engine.tokenizer
    prompts = random_prompts(8, engine.vocab_size, seed=13)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=2))
    for out in outs:
        comp = out.outputs[0]
        assert comp.text == tok.decode(comp.token_ids, skip_special_tokens=True)
    # a multi-byte character split across byte tokens is only emitted once complete
    ids = tok.encode("héllo 🙂 wörld", add_special_tokens=False)
    eng_prompt = tok.encode("x", add_special_tokens=False)
    from rlserve.engine.detokenizer import IncrementalDetokenizer

    d = IncrementalDetokenizer.create(tok, eng_prompt, SamplingParams())
    seen = []
    for t in ids:
        d.feed(t)
        seen.append(d.text)
        assert "\ufffd" not in d.text
    d.flush()
    assert d.text == "héllo 🙂 wörld"


def test_prompt_logprobs_match_forward_pass(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, lo=30, hi=30, seed=14)[0]
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))[0]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert abs(entry[prompt[pos]] - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert set(ref[pos - 1].topk(2).indices.tolist()) <= set(entry)


def test_abort_returns_partial_output_and_frees_blocks(engine):
    engine.add_request("long", [1, 2, 3], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.abort("long") == 1
    outs = engine.step()
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
    assert 0 < len(outs[0].outputs[0].token_ids) < 200
    assert engine.stats.num_running == 0 and engine.pool.usage == 0.0


def test_chunked_prefill_matches_single_chunk(model_dir):
    prompts = random_prompts(3, 2048, lo=200, hi=300, seed=15)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=0)
    whole = make_engine(model_dir, max_num_batched_tokens=2048).generate(prompts, params)
    chunked = make_engine(model_dir, max_num_batched_tokens=48).generate(prompts, params)
    for a, b in zip(whole, chunked):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert torch.allclose(torch.tensor(a.outputs[0].logprobs), torch.tensor(b.outputs[0].logprobs), atol=1e-5)


def test_forced_tokens_are_emitted_with_one_hot_processed_logprobs(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, seed=17)[0]
    forced = [2044, 10, 11, 2045]
    params = SamplingParams(
        temperature=1.0,
        max_tokens=8,
        ignore_eos=True,
        logprobs=0,
        forced_token_ids=forced,
        seed=1,
        logprobs_mode="processed_logprobs",
    )
    comp = engine.generate([prompt], params)[0].outputs[0]
    assert comp.token_ids[:4] == forced and len(comp.token_ids) == 8
    assert comp.logprobs[:4] == [0.0] * 4
    raw_params = SamplingParams(
        temperature=1.0, max_tokens=8, ignore_eos=True, logprobs=0, forced_token_ids=forced, seed=1, logprobs_mode="raw"
    )
    raw = engine.generate([prompt], raw_params)[0].outputs[0]
    ref = hf_logprobs(hf, prompt, raw.token_ids).gather(1, torch.tensor(raw.token_ids).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(raw.logprobs), ref, atol=1e-4)


def test_penalties_and_logit_bias_shape_the_processed_distribution(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, seed=18)[0]
    params = SamplingParams(
        temperature=0.8,
        max_tokens=10,
        ignore_eos=True,
        logprobs=0,
        seed=4,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.7,
        logit_bias={7: 2.5, 9: -1.0},
        logprobs_mode="processed_logprobs",
    )
    comp = engine.generate([prompt], params)[0].outputs[0]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + comp.token_ids])).logits[0].float()
    for pos, token in enumerate(comp.token_ids):
        row = logits[len(prompt) - 1 + pos].clone()
        row[7] += 2.5
        row[9] -= 1.0
        out = comp.token_ids[:pos]
        seen = sorted(set(prompt) | set(out))
        row[seen] = torch.where(row[seen] > 0, row[seen] / 1.3, row[seen] * 1.3)
        for t in set(out):
            row[t] -= 0.7 * out.count(t) + 0.5
        want = torch.log_softmax(row / 0.8, -1)[token].item()
        assert abs(comp.logprobs[pos] - want) < 1e-4
    # a huge bias forces a token
    forced = engine.generate(
        [prompt], SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, logit_bias={42: 100.0})
    )
    assert forced[0].outputs[0].token_ids == [42, 42, 42]


@pytest.mark.parametrize("rows", [1, 4, 5, 16, 56, 57, 64])
def test_projection_forms_agree(rows):
    from rlserve.model.linear import SWAPPED_GEMM_ROWS, linear

    gen = torch.Generator().manual_seed(rows)
    x, weight, bias = (
        torch.randn(rows, 96, generator=gen),
        torch.randn(160, 96, generator=gen),
        torch.randn(160, generator=gen),
    )
    out = linear(x, weight, bias)
    assert out.shape == (rows, 160)
    assert torch.allclose(out, torch.nn.functional.linear(x, weight, bias), atol=1e-5)
    # the swapped form hands back a transposed view; callers must not assume contiguity
    if rows > 1:
        assert (linear(x, weight).stride(0) == 1) == (rows in SWAPPED_GEMM_ROWS)


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="packed projections need MKL")
def test_packed_projection_matches_sgemm_and_follows_weight_changes():
    from rlserve.model.linear import Projection

    gen = torch.Generator().manual_seed(0)
    proj = Projection(96, 160, bias=True)
    assert proj.pack()
    with torch.no_grad():
        for rows in (1, 2, 5, 16, 57, 64, 130):
            x = torch.randn(rows, 96, generator=gen)
            assert torch.allclose(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), atol=1e-5)
        x = torch.randn(8, 96, generator=gen)
        proj.weight[:, :48].mul_(2.0)  # an in-place update through a view (how weight updates land)
        assert torch.allclose(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), atol=1e-5)
        proj.weight = torch.nn.Parameter(torch.randn(160, 96, generator=gen))  # a replaced parameter
        assert torch.allclose(proj(x), torch.nn.functional.linear(x, proj.weight, proj.bias), atol=1e-5)


def packs_panels(engine: Engine) -> bool:
    """Whether this machine's engine keeps its projections in the C GEMM's panels rather than in the
    GEMM libraries' packed layouts (AVX-512, and AVX2 in fp32; CpuKernels.panels_beat_the_libraries)."""
    kernels = engine.runner.kernels
    return kernels is not None and kernels.panels_beat_the_libraries(engine.runner.dtype)


def head_copy(model):
    return model.panel_head if model.panel_head is not None else model.packed_head


def test_pack_weights_setting_decides_the_projection_path(model_dir):
    engine = make_engine(model_dir)
    packed, plain = engine.model, make_engine(model_dir, pack_weights=False).model
    proj = packed.layers[0].mlp.down_proj
    if packs_panels(engine):
        assert proj.panels is not None and proj.packed is None and packed.panel_head is not None
    else:
        expect = torch.backends.mkl.is_available()
        assert (proj.packed is not None) == expect and proj.panels is None
        assert (packed.packed_head is not None) == expect
    plain_proj = plain.layers[0].mlp.down_proj
    assert plain_proj.packed is None and plain_proj.panels is None and head_copy(plain) is None


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="packed projections need MKL")
def test_weights_stay_unpacked_when_the_copy_would_not_fit(model_dir, monkeypatch, caplog):
    import rlserve.engine.runner as runner_module

    engine = make_engine(model_dir)
    need = engine.model.panel_bytes() if packs_panels(engine) else engine.model.packable_bytes()
    assert need > 0
    monkeypatch.setattr(runner_module, "available_memory_bytes", lambda: 2 * need - 1)
    with caplog.at_level("WARNING"):
        tight = make_engine(model_dir)
    qkv = tight.model.layers[0].self_attn.qkv_proj
    assert head_copy(tight.model) is None and qkv.packed is None and qkv.panels is None
    assert "not packing the weights" in caplog.text
    monkeypatch.setattr(runner_module, "available_memory_bytes", lambda: 2 * need)
    assert head_copy(make_engine(model_dir).model) is not None
