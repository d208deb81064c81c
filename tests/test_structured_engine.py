"""Constrained decoding in the engine: outputs obey the grammar on random weights, and the logprobs
returned are those of the distribution each token was drawn from (hand-computed here)."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import llguidance.torch as lt
import pytest
import torch

from rlserve.engine.params import SamplingParams
from rlserve.engine.structured import DEAD_END
from test_engine import hf_logprobs, make_engine, random_prompts

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(model_dir):
    return make_engine(model_dir)


def test_json_schema_regex_and_choice_hold_on_random_weights(engine):
    prompts = random_prompts(3, engine.vocab_size, seed=7)
    cases = [
        ({"json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
        ({"regex": r"[a-c]{2,5}-\d{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2,5}-\d{1,3}", t) or pytest.fail(t)),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
    ]
    for spec, check in cases:
        params = SamplingParams(temperature=1.0, max_tokens=120, seed=11, n=2, structured_outputs=spec)
        for out in engine.generate(prompts, params):
            for comp in out.outputs:
                assert comp.finish_reason == "stop", (spec, comp.text)
                check(comp.text)
    # any object: random weights rarely close it within budget, so the text is an object's prefix
    params = SamplingParams(temperature=1.0, max_tokens=20, seed=1, structured_outputs={"json_object": True})
    for out in engine.generate(prompts, params):
        text = out.outputs[0].text
        assert text.startswith("{")
        if out.outputs[0].finish_reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_constrained_and_free_rows_share_a_step_and_stay_batch_invariant(engine):
    prompt = random_prompts(1, engine.vocab_size, seed=8)[0]
    spec = SamplingParams(temperature=1.0, max_tokens=60, seed=5, structured_outputs={"json": SCHEMA})
    alone = engine.generate([prompt], spec)[0].outputs[0].token_ids
    free = SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=9)
    free_alone = engine.generate([prompt], free)[0].outputs[0].token_ids
    mixed = engine.generate([prompt, prompt, prompt], [spec, free, spec])
    assert mixed[0].outputs[0].token_ids == alone == mixed[2].outputs[0].token_ids
    assert mixed[1].outputs[0].token_ids == free_alone


def _masks_along(engine, grammar: str, tokens: list[int]) -> list[torch.Tensor]:
    """An independent llguidance matcher replayed over the tokens: the allowed set at each position."""
    tok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.vocab_size)
    matcher = llguidance.LLMatcher(tok, grammar)
    masks = []
    for t in tokens:
        bm = lt.allocate_token_bitmask(1, engine.vocab_size)
        lt.fill_next_token_bitmask(matcher, bm, 0)
        allowed = ((bm[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).bool().flatten()
        allowed = allowed[: engine.vocab_size].clone()
        if matcher.is_accepting():
            allowed[list(engine.eos_token_ids)] = True
        masks.append(allowed)
        if t not in engine.eos_token_ids:
            assert matcher.consume_token(t)
    return masks


def test_processed_logprobs_are_the_masked_renormalised_distribution(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, seed=9)[0]
    t = 0.8
    params = SamplingParams(
        temperature=t,
        top_k=40,
        max_tokens=40,
        seed=2,
        logprobs=2,
        structured_outputs={"json": SCHEMA},
        logprobs_mode="processed_logprobs",
    )
    comp = engine.generate([prompt], params)[0].outputs[0]
    grammar = engine.structured.check({"json": SCHEMA}, None)
    masks = _masks_along(engine, grammar, comp.token_ids)
    scaled = hf_logprobs(hf, prompt, comp.token_ids, t)
    for pos, token in enumerate(comp.token_ids):
        row = scaled[pos].masked_fill(~masks[pos], float("-inf"))
        row[row < row.topk(40).values[-1]] = float("-inf")
        want = torch.log_softmax(row, -1)
        assert abs(comp.logprobs[pos] - want[token].item()) < 1e-4
        for tid, lp in comp.top_logprobs[pos].items():  # the top-k are taken from the same distribution
            assert lp == want[tid].item() or abs(lp - want[tid].item()) < 1e-4  # masked ones: -inf both


def test_raw_logprobs_are_the_unmasked_model_distribution(engine, hf):
    prompt = random_prompts(1, engine.vocab_size, seed=10)[0]
    allowed = [5, 17, 300, 1001]
    params = SamplingParams(
        temperature=0.7,
        max_tokens=6,
        seed=4,
        logprobs=0,
        ignore_eos=True,
        allowed_token_ids=allowed,
        logprobs_mode="raw",
    )
    comp = engine.generate([prompt], params)[0].outputs[0]
    assert set(comp.token_ids) <= set(allowed)
    raw = hf_logprobs(hf, prompt, comp.token_ids, 1.0)
    for pos, token in enumerate(comp.token_ids):
        assert abs(comp.logprobs[pos] - raw[pos, token].item()) < 1e-4
    processed = SamplingParams(
        temperature=0.7,
        max_tokens=6,
        seed=4,
        logprobs=0,
        ignore_eos=True,
        allowed_token_ids=allowed,
        logprobs_mode="processed_logprobs",
    )
    comp = engine.generate([prompt], processed)[0].outputs[0]
    scaled = hf_logprobs(hf, prompt, comp.token_ids, 0.7)
    for pos, token in enumerate(comp.token_ids):
        want = torch.log_softmax(scaled[pos, allowed], -1)[allowed.index(token)]
        assert abs(comp.logprobs[pos] - want.item()) < 1e-4


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"json": {"type": "objectx"}}, "objectx"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: foo"}, "foo"),
        ({"choice": []}, "choice"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
    ],
)
def test_bad_grammars_are_rejected_at_the_boundary(engine, spec, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        engine.make_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))


def test_a_grammar_with_no_possible_token_ends_with_a_clear_stop_reason(engine):
    # the grammar wants "x", but allowed_token_ids leaves only tokens that cannot start it
    x = engine.tokenizer.encode("x")[0]
    others = [t for t in range(10, 20) if t != x]
    params = SamplingParams(max_tokens=10, structured_outputs={"regex": "x+"}, allowed_token_ids=others)
    comp = engine.generate([[1, 2, 3]], params)[0].outputs[0]
    assert comp.finish_reason == "stop" and comp.stop_reason == DEAD_END
    assert len(comp.token_ids) == 1 and comp.token_ids[0] in engine.eos_token_ids | {engine.detector_eos}
