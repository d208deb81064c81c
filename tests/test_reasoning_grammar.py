"""With a reasoning parser, an output constraint starts after the reasoning (as vLLM does): the composed
grammar admits free reasoning between the family's tags, then exactly the constrained answer."""

from __future__ import annotations

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from rlserve.engine.params import SamplingParams
from rlserve.engine.structured import CHECKED, GrammarChecker
from rlserve.server.reasoning_grammar import constrain_after_reasoning

SCHEMA = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def checker(tokenizer):
    return GrammarChecker(tokenizer, len(tokenizer))


def composed(checker, tokenizer, parser: str, prompt: str, enable_thinking=None) -> str:
    params = SamplingParams(structured_outputs={CHECKED: checker.grammar({"json": SCHEMA})})
    before = params.structured_outputs[CHECKED]
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    constrain_after_reasoning(checker, tokenizer, params, parser, enable_thinking, ids)
    grammar = params.structured_outputs[CHECKED]
    return "unchanged" if grammar == before else grammar


def accepts(checker, tokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(checker.tokenizer(), grammar)
    ok = all(matcher.consume_token(t) for t in tokenizer.encode(text, add_special_tokens=False))
    return ok and matcher.is_accepting()


def test_reasoning_in_special_token_tags_comes_first_and_is_optional(checker, tokenizer):
    grammar = composed(checker, tokenizer, "qwen3", "<|im_start|>assistant\n")
    assert accepts(checker, tokenizer, grammar, '<think>any {text} <b> at all</think>\n\n{"a": 1}')
    assert accepts(checker, tokenizer, grammar, '{"a": 2}')
    assert not accepts(checker, tokenizer, grammar, "<think>x</think>not json")
    assert not accepts(checker, tokenizer, grammar, '<think>x</think>{"b": 1}')


def test_a_prompt_that_opened_the_reasoning_must_close_it_first(checker, tokenizer):
    grammar = composed(checker, tokenizer, "deepseek_r1", "<|im_start|>assistant\n<think>\n")
    assert accepts(checker, tokenizer, grammar, 'thinking {"a": 0} aloud</think>{"a": 3}')
    assert not accepts(checker, tokenizer, grammar, '{"a": 3}')  # still reasoning: not an answer yet


def test_thinking_off_leaves_the_constraint_as_it_was(checker, tokenizer):
    assert composed(checker, tokenizer, "qwen3", "assistant\n<think>\n\n</think>\n\n") == "unchanged"
    assert composed(checker, tokenizer, "qwen3", "assistant\n", enable_thinking=False) == "unchanged"
    assert composed(checker, tokenizer, None, "assistant\n") == "unchanged"
    assert composed(checker, tokenizer, "granite", "assistant\n") == "unchanged"


def test_text_tags_are_matched_as_text(checker, tokenizer):
    grammar = composed(checker, tokenizer, "mistral", "[INST]hi[/INST]")  # [THINK] is text in this tokenizer
    assert accepts(checker, tokenizer, grammar, '[THINK]hmm [x] ok[/THINK]{"a": 5}')
    assert accepts(checker, tokenizer, grammar, '{"a": 5}')
    assert not accepts(checker, tokenizer, grammar, "[THINK]hmm[/THINK]nope")


def test_the_engine_serves_the_composed_grammar(model_dir, checker, tokenizer):
    from test_engine import make_engine

    engine = make_engine(model_dir)
    grammar = composed(checker, tokenizer, "qwen3", "<|im_start|>assistant\n")
    params = SamplingParams(temperature=1.0, max_tokens=60, seed=2, n=4, structured_outputs={CHECKED: grammar})
    (out,) = engine.generate([tokenizer.encode("hello", add_special_tokens=False)], params)
    for completion in out.outputs:  # random weights: either an answer at once or reasoning cut by the budget
        assert completion.finish_reason == "stop" or completion.text.startswith("<think>"), completion.text
        if completion.finish_reason == "stop":
            assert accepts(checker, tokenizer, grammar, completion.text), completion.text
