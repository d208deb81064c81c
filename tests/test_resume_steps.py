"""`POST /resume?steps=N` (runtime/pause.py): a paused server runs exactly N engine steps, each running request
gaining one token per step, and is frozen again when the reply comes; what the route refuses (its docs/errors.md row is tests/test_errors_control.py's); a `wait` pause
from a frozen engine lets the running requests finish. The engine runs in its own process here; the in-thread
AsyncEngine's form is tests/test_engine_updates.py's pause-mode test."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from conftest import wait_queued
from rlserve.engine.params import SamplingParams
from rlserve.model.make import make_model
from rlserve.runtime.inproc import AsyncEngine
from test_engine import make_engine

PROMPTS = [[11, 22, 33, 44, 55], [100, 7, 300, 9], [5, 6, 7]]
MAX_TOKENS = 40


@pytest.fixture
def url(server):
    return server  # the session's default server: every test here leaves it resumed


def generated(http: httpx.Client) -> int:
    text = http.get("/metrics", params={"format": "prometheus"}).text
    return int(float(re.search(r"^vllm:generation_tokens_total(?:{[^}]*})? (\S+)$", text, re.M).group(1)))


async def _completion(url: str, prompt: list[int]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        body = {
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "temperature": 0,
            "return_token_ids": True,
        }
        r = await http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]


async def queued_behind_a_pause(http: httpx.Client, url: str) -> list[asyncio.Task]:
    """PROMPTS' completions, sent to the paused server and waiting in its queue."""
    assert http.post("/pause", params={"mode": "keep"}).status_code == 200
    tasks = [asyncio.create_task(_completion(url, p)) for p in PROMPTS]
    await asyncio.to_thread(wait_queued, url, len(PROMPTS))
    return tasks


def test_each_step_gives_every_running_request_one_token_then_the_engine_is_frozen(url):
    async def scenario():
        with httpx.Client(base_url=url, timeout=120) as http:
            tasks = await queued_behind_a_pause(http, url)
            start = generated(http)
            for steps in (1, 3, 2):
                r = http.post("/resume", params={"steps": steps})
                assert r.json() == {"status": "paused", "steps": steps}, r.text
                assert http.get("/is_paused").json() == {"is_paused": True}
                await asyncio.sleep(0.05)  # a frozen engine makes nothing more, however long it waits
                assert generated(http) - start == len(PROMPTS) * steps
                start = generated(http)
            assert not any(t.done() for t in tasks)
            assert http.post("/resume").json() == {"status": "resumed"}
            return await asyncio.gather(*tasks)

    try:
        choices = asyncio.run(scenario())
    finally:
        httpx.post(f"{url}/resume", timeout=120)
    assert [len(c["token_ids"]) for c in choices] == [MAX_TOKENS] * len(PROMPTS)

    # the same greedy completions as a server that never paused
    async def unpaused():
        return await asyncio.gather(*(_completion(url, p) for p in PROMPTS))

    again = asyncio.run(unpaused())
    assert [c["token_ids"] for c in choices] == [c["token_ids"] for c in again]


def test_steps_with_nothing_in_flight_end_at_once_and_leave_the_engine_paused(url):
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("/resume", params={"steps": 1000}).json() == {"status": "paused", "steps": 1000}
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/is_paused").json() == {"is_paused": False}


def test_a_wait_pause_from_a_frozen_engine_lets_the_running_requests_finish(url):
    async def scenario():
        with httpx.Client(base_url=url, timeout=120) as http:
            tasks = await queued_behind_a_pause(http, url)
            assert http.post("/resume", params={"steps": 2}).status_code == 200
            r = await asyncio.to_thread(http.post, "/pause", params={"mode": "wait"})
            assert r.json() == {"status": "paused"}
            state = http.get("/metrics", params={"format": "json"}).json()  # the replies may still be on their way
            assert (state["num_running"], state["queue_depth"], state["is_paused"]) == (0, 0, True)
            assert http.post("/resume").json() == {"status": "resumed"}
            return await asyncio.gather(*tasks)

    try:
        choices = asyncio.run(scenario())
    finally:  # a failed check must not leave the module's server paused for the next test
        httpx.post(f"{url}/resume", timeout=120)
    assert all(len(c["token_ids"]) == MAX_TOKENS and c["finish_reason"] == "length" for c in choices)


@pytest.mark.parametrize("steps", ["-1", "1.5", "x", "", "9" * 5000, "\u0661"])
def test_a_bad_step_count_is_refused_and_the_server_keeps_serving(url, steps):
    r = httpx.post(f"{url}/resume", params={"steps": steps}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "steps", r.text
    assert "steps must be a whole number of at least 1" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/is_paused", timeout=120).json() == {"is_paused": False}
    r = httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}, timeout=120)
    assert r.status_code == 200


def test_in_thread_engine_resume_longer_than_its_requests_ends_when_they_finish(tmp_path):
    """The in-thread engine (engine.core_process = false) counts steps too, and a count its requests outlast
    ends when they finish: the resume returns, the engine is frozen, the outputs are whole."""
    aeng = AsyncEngine(engine=make_engine(make_model("tiny", tmp_path / "tiny", seed=0)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

    async def finish(prompt, rid):
        out = None
        async for out in aeng.generate(prompt, params, rid):  # noqa: B007 (the last one is the answer)
            pass
        return out

    async def scenario():
        await aeng.pause("keep")
        tasks = [asyncio.create_task(finish(p, f"r{i}")) for i, p in enumerate(PROMPTS)]
        while await aeng.call(lambda e: len(e.scheduler.waiting)) < len(PROMPTS):
            await asyncio.sleep(0.005)
        await aeng.resume(steps=2)
        assert await aeng.call(lambda e: e.generation_tokens) == 2 * len(PROMPTS) and aeng.paused
        await asyncio.wait_for(aeng.resume(steps=1000), 120)  # a hang guard only
        assert aeng.paused
        return await asyncio.gather(*tasks)

    try:
        outs = asyncio.run(scenario())
    finally:
        aeng.shutdown()
    assert [len(o.outputs[0].token_ids) for o in outs] == [6] * len(PROMPTS)
