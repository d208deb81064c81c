"""Batch-invariant mode: a request's tokens and logprobs are bitwise the same alone and in any batch."""

from __future__ import annotations

import random

import pytest
import torch

from rlserve.config.load import load_config
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams

MAX_LEN = 256


def make_engine(model_dir, offload: bool = False, dtype: str = "float32", **engine) -> Engine:
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.dtype = dtype
    cfg.model.max_model_len = MAX_LEN
    cfg.engine.kv_cache_bytes = engine.pop("kv_cache_bytes", 8 << 20)
    cfg.engine.batch_invariant = True
    for k, v in engine.items():
        setattr(cfg.engine, k, v)
    if offload:
        cfg = Config.model_validate({**cfg.model_dump(), "kv_cache_offload": {"cpu": {"num_bytes": 32 << 20}}})
    return Engine(cfg)


@pytest.fixture(scope="module")
def engines(model_dir):
    """Plain; chunked prefill (16-token steps, few sequences); a pool small enough that prefix
    blocks are evicted to the CPU offload tier and restored from it."""
    return [
        make_engine(model_dir),
        make_engine(model_dir, max_num_batched_tokens=16, max_num_seqs=5),
        make_engine(model_dir, offload=True, kv_cache_bytes=600 << 10),
    ]


def subjects(vocab: int, rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    """Prompts with shared prefixes (prefix-cache hits), greedy and seeded sampling with filters."""
    stems = [[rng.randrange(vocab) for _ in range(rng.choice((5, 20, 40)))] for _ in range(3)]
    out = []
    for i in range(12):
        prompt = rng.choice(stems) + [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        if i % 3 == 0:
            params = SamplingParams(temperature=0, max_tokens=rng.randint(1, 8), ignore_eos=True, logprobs=2)
        else:
            params = SamplingParams(temperature=rng.choice((0.7, 1.0)), top_p=rng.choice((1.0, 0.9)),
                                    top_k=rng.choice((0, 50)), seed=rng.randrange(1 << 30), n=rng.choice((1, 2)),
                                    max_tokens=rng.randint(1, 8), ignore_eos=True, logprobs=1)  # fmt: skip
        out.append((prompt, params))
    return out


def run_alone(engine: Engine, prompt, params):
    return engine.generate([prompt], params)[0].outputs


def run_in_batch(engine: Engine, rng: random.Random, prompt, params, vocab: int):
    """The subject among 0-6 other requests of any length, arriving before, with or after it."""
    fillers = rng.randint(0, 6)
    subject_at = rng.randint(0, fillers)
    rid, done = None, {}
    for i in range(fillers + 1):
        if i == subject_at:
            rid = f"subject-{rng.random()}"
            engine.add_request(rid, prompt, params)
        if i < fillers:
            other = [rng.randrange(vocab) for _ in range(rng.randint(1, 90))]
            if rng.random() < 0.3:  # shares the subject's leading blocks
                other = prompt[: rng.randint(1, len(prompt))] + other
            engine.add_request(f"filler-{rng.random()}", other, SamplingParams(
                temperature=rng.choice((0, 1.0)), max_tokens=rng.randint(1, 12), ignore_eos=True,
                logprobs=rng.choice((0, 3, None)),
                n=rng.choice((1, 1, 3))))  # fmt: skip
        for _ in range(rng.randint(0, 3)):
            for out in engine.step():
                done[out.request_id] = out
    while engine.has_unfinished():
        for out in engine.step():
            done[out.request_id] = out
    return done[rid].outputs


def check_random_batches(engines: list[Engine], count: int, seed: int) -> None:
    vocab = engines[0].vocab_size
    rng = random.Random(seed)
    cases = subjects(vocab, rng)
    reference = [run_alone(engines[0], prompt, params) for prompt, params in cases]
    checked = 0
    for case in range(count):
        k = rng.randrange(len(cases))
        engine = engines[case % len(engines)]
        got = run_in_batch(engine, rng, *cases[k], vocab)
        for want, have in zip(reference[k], got, strict=True):
            assert have.token_ids == want.token_ids, f"case {case}: tokens differ"
            assert have.logprobs == want.logprobs, f"case {case}: logprobs differ"  # floats compared exactly
            assert have.top_logprobs == want.top_logprobs, f"case {case}: top logprobs differ"
        checked += 1
    assert checked == count


def test_tokens_and_logprobs_bitwise_equal_alone_and_in_random_batches(engines):
    check_random_batches(engines, 240, seed=1234)
    offload = engines[2].offload
    assert offload is not None and offload.stats.cpu_hits > 0  # restored KV was among the cases


def test_bf16_is_bitwise_batch_invariant_too(model_dir):
    """bf16 weights and activations (the dtype RL trains in): plain and chunked prefill, 80 random batches."""
    bf16 = [make_engine(model_dir, dtype="bfloat16"),
            make_engine(model_dir, dtype="bfloat16", max_num_batched_tokens=16, max_num_seqs=5)]  # fmt: skip
    assert bf16[0].dtype == torch.bfloat16
    check_random_batches(bf16, 80, seed=4321)


def test_prompt_logprobs_rescore_generation_bitwise(engines):
    """A finished sequence fed back as a prompt gets the logprobs generation returned (raw distribution)."""
    engine = engines[1]  # chunked: the re-score's rows come from other chunks than generation's
    rng = random.Random(7)
    for _ in range(6):
        prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(2, 50))]
        gen = run_alone(engine, prompt, SamplingParams(temperature=1.0, seed=rng.randrange(1000), max_tokens=12,
                                                       ignore_eos=True, logprobs=0))[0]  # fmt: skip
        again = engine.generate([prompt + gen.token_ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        rescored = [again.prompt_logprobs[len(prompt) + i][t] for i, t in enumerate(gen.token_ids)]
        assert rescored == gen.logprobs


def test_seeded_sampling_reproducible_across_engines(model_dir, engines):
    """A fresh engine (a restart) samples the same tokens with the same seed, bit for bit."""
    params = SamplingParams(temperature=1.0, seed=99, n=2, max_tokens=10, ignore_eos=True, logprobs=0)
    prompt = list(range(5, 30))
    first = run_alone(engines[0], prompt, params)
    again = run_alone(make_engine(model_dir), prompt, params)
    assert [(o.token_ids, o.logprobs) for o in first] == [(o.token_ids, o.logprobs) for o in again]


def test_vllm_spellings_turn_it_on(monkeypatch):
    assert load_config(["--batch-invariant"]).engine.batch_invariant is True
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    assert load_config([]).engine.batch_invariant is True
    assert load_config(["--engine.batch_invariant", "false"]).engine.batch_invariant is False


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_a_dtype_its_kernels_lack_is_refused(model_dir, dtype):
    """Its kernels run float32 and bfloat16; any other dtype would fall back to row-count-dependent matmuls."""
    with pytest.raises(ValueError, match=f"float32 or bfloat16, its kernels' dtypes \\(model.dtype={dtype}\\)"):
        make_engine(model_dir, dtype=dtype)
