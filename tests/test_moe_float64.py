"""Every layout of the mixture-of-experts engine in float64 (model.dtype=float64) against transformers' float64
forward (tests/float64_reference.py), for the tiny-moe and qwen3-30b-a3b-mini presets: one rank, tensor
parallelism splitting every expert, expert parallelism over the two ranks of one engine, and over four ranks of
data-parallel engines (tp x dp = 1 x 4 and 2 x 2). Each gives transformers' greedy tokens and routed experts, its
logprobs within 1e-5 of transformers as shipped and within 1e-9 of a forward that is float64 throughout.

float64 takes rounding out of the way: in float32 transformers' own forward of these random models moves by more
than 1e-5 (test_expert_parallel.py and test_moe_mini.py hold the float32 layouts to that precision), so only here
does a tight bar tell a layout that computes transformers' function from one that computes a neighbour of it.
The engines and the reference run in child processes: mini's float64 copy is 3.6 GB."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from float64_reference import Reference, assert_matches, float64_references, in_child
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model
from test_engine import random_prompts
from test_expert_parallel import dp_engines_answers, moe_engine

FLOAT64 = {"dtype": "float64", "max_model_len": 128}
MAX_TOKENS = 12


@dataclass
class Case:
    model_dir: Path
    prompts: list[list[int]]
    references: list[Reference]


@pytest.fixture(scope="module", params=["tiny-moe", "qwen3-30b-a3b-mini"])
def case(request, tmp_path_factory) -> Case:
    if request.param == "tiny-moe":
        model_dir = make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe", seed=0)
        prompts = random_prompts(4, 1000, lo=5, hi=40, seed=3)
    else:  # 1.8 GB of fp32 experts, built once per machine (the benchmarks' cache)
        model_dir = make_model("qwen3-30b-a3b-mini", bench_cache_dir() / "qwen3-30b-a3b-mini")
        prompts = random_prompts(4, 1000, lo=4, hi=10, seed=5)
    return Case(model_dir, prompts, float64_references(model_dir, prompts, MAX_TOKENS))


def _answers(model_dir: str, prompts: list[list[int]], parallel: dict) -> list[tuple]:
    """(token ids, logprobs, routed experts) of one engine in float64 (a child process)."""
    engine = moe_engine(model_dir, engine={"kv_cache_bytes": 16 << 20}, model=FLOAT64, **parallel)
    try:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
        outs = [o.outputs[0] for o in engine.generate(prompts, params)]
        return [(o.token_ids, o.logprobs, o.routed_experts) for o in outs]
    finally:
        engine.close()


@pytest.mark.parametrize(
    "parallel", [{}, {"tp": 2}, {"tp": 2, "enable_expert_parallel": True}], ids=["one-rank", "tp2", "ep2"]
)
def test_one_engine_matches_transformers_in_float64(case, parallel):
    answers = in_child(_answers, str(case.model_dir), case.prompts, parallel)
    for ref, answer in zip(case.references, answers, strict=True):
        assert_matches(ref, *answer)


@pytest.mark.parametrize("tp,dp", [(1, 4), (2, 2)])
def test_expert_parallel_over_four_ranks_of_data_parallel_engines_matches_transformers_in_float64(case, tp, dp):
    answers = dp_engines_answers(case.model_dir, case.prompts, tp, dp, model=FLOAT64)
    assert [rank for rank, *_ in answers] == list(range(dp))
    for rank, *answer in answers:
        assert_matches(case.references[rank], *answer)
