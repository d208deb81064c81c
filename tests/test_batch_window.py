"""The batch-forming window (engine.batch_window_ms, the MLX --flush-interval-ms): an idle engine holds its
first requests until the window ends or max_num_seqs wait; a busy one never waits. Step counts, not times."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams


def make_engine(model_dir, window_ms: float, max_num_seqs: int = 5) -> Engine:
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), 256
    cfg.engine.kv_cache_bytes, cfg.engine.max_num_seqs, cfg.engine.batch_window_ms = 16 << 20, max_num_seqs, window_ms
    return Engine(cfg)


def test_a_lone_request_is_held_until_the_window_ends_and_no_longer(model_dir):
    engine = make_engine(model_dir, 2000)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.scheduler.waiting[0].request.arrival_time = 0.0
    now[0] = 1.999
    assert engine.step_requests() == [] and engine.stats.num_steps == 0  # inside the window: held
    now[0] = 2.0
    engine.step_requests()
    assert engine.stats.num_steps == 1  # the window's end admits it


def test_max_num_seqs_waiting_close_the_window_and_run_in_one_step(model_dir):
    engine = make_engine(model_dir, 60_000)
    for i in range(5):
        engine.add_request(str(i), [1, 2, 3 + i], SamplingParams(max_tokens=1, ignore_eos=True))
        if i < 4:
            assert engine.step_requests() == [] and engine.stats.num_steps == 0
    touched = engine.step_requests()
    assert engine.stats.num_steps == 1 and len(touched) == 5
    assert all(req.finished and req.max_batch_size == 5 for req in touched)


def test_a_busy_engine_admits_at_once(model_dir):
    engine = make_engine(model_dir, 2000)
    now = [0.0]
    engine.scheduler.clock = lambda: now[0]
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.scheduler.waiting[0].request.arrival_time = 0.0
    now[0] = 2.0
    engine.step_requests()  # "a" runs from here on
    engine.add_request("late", [4, 5, 6], SamplingParams(max_tokens=1, ignore_eos=True))
    engine.scheduler.waiting[0].request.arrival_time = now[0]  # its own window would run to 4.0
    touched = engine.step_requests()
    assert engine.stats.num_steps == 2 and [r.request_id for r in touched if r.finished] == ["late"]


def test_window_off_runs_the_first_request_at_once(model_dir):
    engine = make_engine(model_dir, 0)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True))
    assert engine.step_requests() and engine.stats.num_steps == 1


@pytest.mark.parametrize("core_process", ["true", "false"], ids=["engine-process", "engine-thread"])
def test_server_forms_one_batch_of_five_from_a_burst(core_process):
    url, proc = start_server(
        "--engine.batch-window-ms", "600000", "--engine.max-num-seqs", "5", "--engine.core-process", core_process
    )
    try:
        body = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=300) as client:
                return await asyncio.gather(*(client.post(f"{url}/generate", json=body) for _ in range(5)))

        before = httpx.get(f"{url}/metrics?format=json", timeout=30).json()["num_steps"]
        answers = asyncio.run(burst())
        assert [r.status_code for r in answers] == [200] * 5
        assert [r.json()["metadata"]["batch_size"] for r in answers] == [5] * 5
        # prefilled together, then decoded together: 3 tokens take 3 steps for all five
        assert httpx.get(f"{url}/metrics?format=json", timeout=30).json()["num_steps"] - before == 3
    finally:
        stop_server(proc)


def test_server_runs_a_lone_request_when_the_window_ends():
    url, proc = start_server("--flush-interval-ms", "2000", "--max-batch", "5")
    try:
        before = httpx.get(f"{url}/metrics?format=json", timeout=30).json()["num_steps"]
        answer = httpx.post(
            f"{url}/generate", json={"prompt": "alone", "max_tokens": 4, "ignore_eos": True}, timeout=300
        ).json()
        assert answer["metadata"]["batch_size"] == 1 and len(answer["completion_ids"]) == 4
        # held without a step until the window ended, then one step per token: no step ran empty
        assert httpx.get(f"{url}/metrics?format=json", timeout=30).json()["num_steps"] - before == 4
    finally:
        stop_server(proc)
