"""n > 1: the siblings share the prompt's KV even when sample 0 stops on its very first token."""

from __future__ import annotations

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams


def test_siblings_keep_the_prompt_kv_when_sample_zero_stops_at_once():
    engine = Engine(Config(engine={"kv_cache_bytes": 16 << 20}, model={"max_model_len": 256}))
    prompt = [5, 9, 200, 17]
    params = dict(n=4, temperature=2.0, seed=0, max_tokens=40, ignore_eos=True, logprobs=0)
    free = engine.pool.num_free
    plain = engine.generate(prompt, SamplingParams(**params))[0].outputs
    first = plain[0].token_ids[0]
    stopped = engine.generate(prompt, SamplingParams(**params, stop_token_ids=[first]))[0].outputs
    assert stopped[0].token_ids == [first] and stopped[0].finish_reason == "stop"
    # siblings stop where they draw the same token; up to there, same seed and same prompt KV: same samples
    longer = [i for i in range(1, 4) if plain[i].token_ids[0] != first]
    assert longer, "pick another seed: every sample drew the stop token first"
    for i in range(1, 4):
        n = len(stopped[i].token_ids)
        assert stopped[i].token_ids == plain[i].token_ids[:n]
        assert max(abs(a - b) for a, b in zip(stopped[i].logprobs, plain[i].logprobs[:n])) < 1e-4
    assert all(len(stopped[i].token_ids) > 1 for i in longer)
    assert engine.pool.num_free == free and not engine.scheduler.running
