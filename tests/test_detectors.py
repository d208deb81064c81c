"""prime-rl's gibberish and repetition detectors: each fires exactly where its condition holds on
the model's own distribution (computed here with a transformers forward pass), never elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from rlserve.config.schema import Config, GibberishDetectionConfig, RepetitionDetectionConfig
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from test_engine import random_prompts

THRESHOLD = 1000  # token ids above this are "rare"


def detector_engine(model_dir, gibberish=None, repetition=None) -> Engine:
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len, cfg.engine.kv_cache_bytes = str(model_dir), 256, 4 << 20
    cfg.logits_processors.gibberish_detection = gibberish
    cfg.logits_processors.repetition_detection = repetition
    return Engine(cfg)


def next_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)


def plan_tokens(hf, prompt: list[int], fire_at: int | None, length: int = 10) -> list[int]:
    """Forced tokens that are rare-but-likely or unlikely-but-common, never both; at `fire_at`, the
    least likely rare token (both)."""
    ids, tokens = list(prompt), []
    for j in range(length):
        lp = next_logprobs(hf, ids)
        if j == fire_at:
            t = THRESHOLD + 1 + int(lp[THRESHOLD + 1 :].argmin())
        elif j % 2:
            t = THRESHOLD + 1 + int(lp[THRESHOLD + 1 :].argmax())
        else:
            t = int(lp[: THRESHOLD + 1].argmin())
        tokens.append(t)
        ids.append(t)
    return tokens


@pytest.mark.parametrize("fire_at", [None, 0, 5])
def test_gibberish_fires_exactly_on_a_rare_token_drawn_at_high_entropy(model_dir, hf, fire_at):
    engine = detector_engine(
        model_dir, gibberish=GibberishDetectionConfig(token_id_threshold=THRESHOLD, logprob_offset=0.0)
    )
    floor = -math.log(engine.vocab_size)
    prompt = random_prompts(1, engine.vocab_size, seed=40)[0]
    forced = plan_tokens(hf, prompt, fire_at)
    # the condition, from transformers: which forced tokens are rare and drawn below the floor
    ids, hits = list(prompt), []
    for t in forced:
        lp = float(next_logprobs(hf, ids)[t])
        assert abs(lp - floor) > 1e-3  # far from the boundary, whatever the rounding
        hits.append(t > THRESHOLD and lp < floor)
        ids.append(t)
    assert hits.index(True) == fire_at if fire_at is not None else not any(hits)

    params = SamplingParams(
        temperature=1.0,
        max_tokens=len(forced),
        ignore_eos=True,
        logprobs=0,
        forced_token_ids=forced,
        logprobs_mode="processed_logprobs",  # the forced EOS is one-hot in the distribution sampled from
    )
    (out,) = engine.generate([prompt], params)
    comp = out.outputs[0]
    if fire_at is None:
        assert comp.token_ids == forced and comp.finish_reason == "length" and comp.stop_reason is None
    else:
        assert comp.token_ids == forced[: fire_at + 1] + [engine.detector_eos]
        assert (comp.finish_reason, comp.stop_reason) == ("stop", "gibberish_detection")
        assert comp.logprobs[-1] == 0.0


def test_repetition_fires_after_window_confident_tokens_in_a_row(model_dir, hf):
    prompt = random_prompts(1, 2048, seed=41)[0]
    plain = detector_engine(model_dir)
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    tokens = plain.generate([prompt], greedy)[0].outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    top = logits.softmax(-1).amax(-1).tolist()  # top probability at each sampled token
    window = 3
    # a threshold between two observed values (far from both) under which a run of `window`
    # confident tokens first completes at `fire_at`, after at least one shorter run broke off
    for threshold in sorted((a + b) / 2 for a, b in zip(sorted(top), sorted(top)[1:]) if b - a > 1e-3):
        run, fire_at, broken = 0, None, False
        for j, p in enumerate(top):
            broken |= 0 < run < window and p <= threshold
            run = run + 1 if p > threshold else 0
            if run == window:
                fire_at = j
                break
        if fire_at is not None and fire_at < len(top) - 1 and broken:
            break
    else:
        pytest.fail(f"no threshold gives a broken run before a full one in {top}")

    engine = detector_engine(model_dir, repetition=RepetitionDetectionConfig(window=window, prob_threshold=threshold))
    comp = engine.generate([prompt], greedy)[0].outputs[0]
    assert comp.token_ids == tokens[: fire_at + 1] + [engine.detector_eos]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", "repetition_detection")
    # a window longer than any confident run never fires
    engine = detector_engine(model_dir, repetition=RepetitionDetectionConfig(window=41, prob_threshold=threshold))
    comp = engine.generate([prompt], greedy)[0].outputs[0]
    assert comp.token_ids == tokens and comp.finish_reason == "length"


def test_prime_rl_defaults():
    g, r = GibberishDetectionConfig(), RepetitionDetectionConfig()
    assert (g.token_id_threshold, g.logprob_offset, r.window, r.prob_threshold) == (100_000, 2.0, 3000, 0.99)
    assert Config().logits_processors.gibberish_detection is None  # off unless the section is present
