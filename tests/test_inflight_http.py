"""The in-flight policy chosen per update over HTTP (`inflight_update_policy` on /update_weights and
/update_weights_from_disk, and beside update_info in a trainer's vLLM-style push), with the server's
engine.inflight_update_policy as the default.

"In flight": the streams are queued behind a pause and advanced by one engine step (`/resume?steps=1`: each
prefills and delivers its first token, and the engine is frozen again), the update lands while they are frozen,
then they resume. Each asks for nearly the whole context, so there is a long second span to check."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server, wait_queued
from rlserve.model.make import make_model

PROMPTS = [[11, 22, 33, 44, 55], [100, 7, 300, 9]]
CONTEXT = 1024
LONG = CONTEXT - 8  # tokens per stream: within the context


@pytest.fixture(scope="module")
def server(root):
    # the server's default is abort: a call without the field must get it, one with the field its own
    url, proc = start_server(
        "--weight_roots",
        json.dumps([str(root)]),
        "--engine.inflight_update_policy",
        "abort",
        "--model.max_model_len",
        str(CONTEXT),
    )
    try:
        yield url
    finally:
        stop_server(proc)


async def _stream(http: httpx.AsyncClient, prompt: list[int], first: asyncio.Event) -> dict:
    body = {
        "token_ids": prompt,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_tokens": LONG, "ignore_eos": True, "logprobs": 0},
    }
    tokens, logprobs, last = [], [], {}
    async with http.stream("POST", "/inference/v1/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            choice = json.loads(line[5:])["choices"][0]
            tokens += choice["token_ids"]
            logprobs += [e["logprob"] for e in choice["logprobs"]["content"]]
            last = choice
            if tokens:
                first.set()
    return {**last, "token_ids": tokens, "logprobs": logprobs}


def posting(url: str, route: str, body: dict) -> Callable[[], dict]:
    def post() -> dict:
        r = httpx.post(f"{url}{route}", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    return post


def pushing(url: str, weights: Path, body: dict) -> Callable[[], dict]:
    """A trainer (tests/vllm_trainer.py, TRL's calls) joins and pushes `weights` with `body` beside update_info."""

    def push() -> dict:
        plan = [["join"], ["push", str(weights / "model.safetensors"), {"body": body, "generate": False}], ["shutdown"]]
        trainer = Path(__file__).with_name("vllm_trainer.py")
        run = subprocess.run(
            [sys.executable, str(trainer), url, json.dumps(plan)], capture_output=True, text=True, timeout=600
        )
        steps = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
        assert run.returncode == 0 and [s["status"] for s in steps] == [200, 200, 200], (steps, run.stderr[-2000:])
        return {"policy_version": steps[1]["after"]}

    return push


def run_update(url: str, update: Callable[[], dict]) -> tuple[dict, list[dict]]:
    """Streams in flight, frozen by a pause, `update()`, resume: (update answer, stream results)."""

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300) as http:
            (await http.post("/pause", params={"mode": "keep"})).raise_for_status()
            try:
                firsts = [asyncio.Event() for _ in PROMPTS]
                tasks = [asyncio.ensure_future(_stream(http, p, e)) for p, e in zip(PROMPTS, firsts)]
                await asyncio.to_thread(wait_queued, url, len(PROMPTS))
                (await http.post("/resume", params={"steps": 1})).raise_for_status()
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in firsts)), 300)  # a hang guard only
                assert not any(t.done() for t in tasks)
                answer = await asyncio.to_thread(update)
            finally:  # a failed check must not leave the module's server paused for the next test
                (await http.post("/resume")).raise_for_status()
            return answer, await asyncio.gather(*tasks)

    return asyncio.run(scenario())


def new_span_errors(weights, outs: list[dict], version: int) -> list[float]:
    """|logprob - transformers' forward of `weights`| of every token produced under policy_version `version`."""
    hf = AutoModelForCausalLM.from_pretrained(weights, dtype=torch.float32).eval()
    errors = []
    for prompt, out in zip(PROMPTS, outs):
        (before, after) = out["weight_versions"]
        assert before["start"] == 0 < before["end"] == after["start"] and after["policy_version"] == version
        ids = prompt + out["token_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
        for i in range(after["start"], after["end"]):
            pos = len(prompt) + i - 1  # the logits that predict completion token i
            errors.append(abs(out["logprobs"][i] - lp[pos, out["token_ids"][i]].item()))
    return errors


@pytest.mark.parametrize(
    "route,policy,seed",
    [
        ("/update_weights", "recompute", 1),
        ("/update_weights_from_disk", "recompute", 2),
        ("/update_weights", "recompute_if_older_than:0", 3),
    ],
)
def test_recompute_makes_later_logprobs_those_of_the_new_weights(server, root, route, policy, seed):
    weights = make_model("tiny", root / f"recompute-{seed}", seed=seed)
    field = "weight_dir" if route == "/update_weights" else "model_path"
    answer, outs = run_update(server, posting(server, route, {field: str(weights), "inflight_update_policy": policy}))
    version = answer.get("policy_version") or outs[0]["policy_version"]
    assert all(len(o["token_ids"]) == LONG for o in outs)
    # against transformers: this tiny model's fp32 noise is ~1e-5 for any request (a fresh one too)
    assert max(new_span_errors(weights, outs, version)) <= 3e-5
    # and what a fresh request under the new weights gives from the same point, within the same noise (the two
    # run in other batches: 1.03e-5 apart once on an AVX-512 machine); keep is > 1e-3 off (below)
    for prompt, out in zip(PROMPTS, outs):
        switch = out["weight_versions"][1]["start"]
        fresh = httpx.post(
            f"{server}/inference/v1/generate",
            json={
                "token_ids": prompt + out["token_ids"][:switch],
                "sampling_params": {"temperature": 0, "max_tokens": LONG - switch, "ignore_eos": True, "logprobs": 0},
            },
            timeout=300,
        ).json()["choices"][0]
        assert fresh["policy_version"] == version and fresh["token_ids"] == out["token_ids"][switch:]
        lps = [e["logprob"] for e in fresh["logprobs"]["content"]]
        assert max(abs(a - b) for a, b in zip(lps, out["logprobs"][switch:])) <= 3e-5


@pytest.mark.parametrize("policy", ["keep", "recompute_if_older_than:1"])
def test_keep_goes_on_over_the_old_kv(server, root, policy):
    """The same check fails without recompute (the KV is one version old, so :1 keeps it too)."""
    seed = {"keep": 4, "recompute_if_older_than:1": 6}[policy]  # weights other than the ones serving
    weights = make_model("tiny", root / f"keep-{seed}", seed=seed)
    body = {"weight_dir": str(weights), "inflight_update_policy": policy}
    answer, outs = run_update(server, posting(server, "/update_weights", body))
    assert all(len(o["token_ids"]) == LONG for o in outs)
    assert max(new_span_errors(weights, outs, answer["policy_version"])) > 1e-3


@pytest.mark.parametrize("body", [{"inflight_update_policy": "abort"}, {}], ids=["abort", "server-default"])
def test_abort_returns_partial_outputs_with_their_tokens(server, root, body):
    weights = make_model("tiny", root / f"abort-{len(body)}", seed=5)
    _, outs = run_update(server, posting(server, "/update_weights", {"weight_dir": str(weights), **body}))
    for out in outs:
        assert out["finish_reason"] == "abort" and 0 < len(out["token_ids"]) < LONG
        assert len(out["logprobs"]) == len(out["token_ids"])


@pytest.mark.parametrize("route", ["/update_weights", "/update_weights_from_disk"])
def test_an_unknown_policy_is_a_400_naming_the_field(server, root, route):
    field = "weight_dir" if route == "/update_weights" else "model_path"
    r = httpx.post(f"{server}{route}", json={field: str(root), "inflight_update_policy": "sometimes"}, timeout=60)
    assert r.status_code == 400 and "inflight_update_policy" in r.text


@pytest.mark.parametrize("policy", ["keep", "recompute"])
def test_a_trainer_push_takes_its_policy_beside_update_info(server, root, policy):
    """TRL's push (start, /update_weights {update_info, inflight_update_policy}, finish) over the server's
    default of abort: the policy sent with the push decides, applied at the commit (the finish)."""
    weights = make_model("tiny", root / f"push-{policy}", seed={"keep": 7, "recompute": 8}[policy])
    answer, outs = run_update(server, pushing(server, weights, {"inflight_update_policy": policy}))
    assert all(out["finish_reason"] == "length" and len(out["token_ids"]) == LONG for out in outs)
    errors = new_span_errors(weights, outs, answer["policy_version"])
    assert max(errors) <= 3e-5 if policy == "recompute" else max(errors) > 1e-3
