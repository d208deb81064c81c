"""POST /v1/rescore on a batch-invariant server: generation under concurrent load re-scores bit for bit,
and any difference or a version change is refused (fail closed)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.client import InferenceClient
from rlserve.client.errors import BadRequest


@pytest.fixture(scope="module")
def invariant_server():
    url, proc = start_server("--batch-invariant", "--engine.max_num_batched_tokens", "32")
    try:
        yield url
    finally:
        stop_server(proc)


async def _samples(url: str, count: int):
    rng = random.Random(3)
    async with InferenceClient(url) as client:
        prompts = [[rng.randrange(5, 2000) for _ in range(rng.randint(2, 60))] for _ in range(count)]
        return await asyncio.gather(*(
            client.generate(token_ids=p, max_tokens=rng.randint(1, 16), temperature=1.0, seed=rng.randrange(1000),
                            sampling_params={"ignore_eos": True}, return_text=False)
            for p in prompts
        ))  # fmt: skip


def test_rescore_equals_generation_under_load_and_refuses_any_difference(invariant_server):
    samples = asyncio.run(_samples(invariant_server, 12))

    async def check():
        async with InferenceClient(invariant_server) as client:
            reports = await asyncio.gather(*(client.rescore(s) for s in samples))
            for s, report in zip(samples, reports):
                assert report["bitwise_equal"] and report["num_mismatches"] == 0 and report["batch_invariant"]
                assert report["rescored_logprobs"] == s.logprobs
            tampered = dataclasses.replace(
                samples[0], logprobs=[samples[0].logprobs[0] * (1 + 2**-20)] + samples[0].logprobs[1:]
            )
            with pytest.raises(BadRequest) as err:
                await client.rescore(tampered)
            assert err.value.status == 409 and "differ" in str(err.value)

    asyncio.run(check())
    s = samples[1]
    body = {
        "prompt_ids": s.prompt_ids,
        "completion_ids": s.completion_ids,
        "logprobs": s.logprobs,
        "policy_version": s.policy_version + 1,
    }
    r = httpx.post(f"{invariant_server}/v1/rescore", json=body, timeout=60)
    assert r.status_code == 409 and r.json()["error"]["param"] == "policy_version"
    r = httpx.post(f"{invariant_server}/v1/rescore", json={**body, "logprobs": [0.0]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
