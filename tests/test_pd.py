"""Prefill/decode disaggregation: `deployment.type = "disaggregated"` with 1 prefill + 1 decode server behind the
real vllm-router in P/D mode, KV pulled from P to D over TCP. Outputs equal a single server's, D computes none of
the transferred prompt tokens, P's pinned blocks come back after success, a client abort and a dead D, a weight
update between P's prefill and D's pull makes D recompute, and SIGTERM leaves no process behind."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import re
import signal

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import start_server, stop_server
from deploy_helpers import (
    descendants,
    replicas,
    sigterm_leaves_nothing,
    start_deployment,
    stop_deployment,
    wait_for,
)
from rlserve.model.make import make_model

PIN_TIMEOUT_S = 20  # short enough for the dead-decode test; waits below are generous hang guards
BLOCK = 16


@pytest.fixture(scope="module")
def single(root):
    # one torch thread, as each of the deployment's two replicas gets on this machine's cores: matmul reductions
    # split differently over threads round differently
    url, proc = start_server(
        "--engine.kv_cache_bytes",
        str(16 << 20),
        "--weight_roots",
        json.dumps([str(root)]),
        "--num_threads",
        str(max(1, (os.cpu_count() or 1) // 2)),
    )
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def pd(root):
    public, admin, proc = start_deployment(
        "--deployment.type",
        "disaggregated",
        "--kv_transfer.pin_timeout_s",
        str(PIN_TIMEOUT_S),
        "--weight_roots",
        json.dumps([str(root)]),
        "--engine.kv_cache_bytes",
        str(16 << 20),
    )
    try:
        rows = sorted(replicas(admin), key=lambda r: r["index"])
        assert [r["role"] for r in rows] == ["prefill", "decode"]
        yield {
            "public": public,
            "admin": admin,
            "proc": proc,
            "p": rows[0]["url"],
            "d": rows[1]["url"],
            "d_pid": rows[1]["pid"],
        }
    finally:
        stop_deployment(proc)


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts per test: D's prefix cache starts cold for each
    return [[rng.randrange(10, 1000) for _ in range(n)] for n in lengths]


def completion(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1, "return_token_ids": True} | extra
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(x - y) <= 1e-5 for x, y in zip(got, want))


def warm(url: str, prompt: list[int]) -> None:
    """D computes a prompt's last block against KV it did not compute, as any prefix-cache hit does; the single
    server's outputs are compared in the same state (a cold prefill of the whole prompt differs by ~1e-5 in fp32)."""
    completion(url, prompt, max_tokens=1)


def same_choice(a: dict, b: dict) -> None:
    assert a["token_ids"] == b["token_ids"]
    assert close(a["logprobs"]["token_logprobs"], b["logprobs"]["token_logprobs"])


def pinned(url: str) -> float:
    return metric(url, "rlserve:kv_transfer_pinned_blocks")


def test_outputs_equal_a_single_server_and_d_computes_no_transferred_token(pd, single):
    d = pd["d"]
    lengths = [40, 75, 100, 130]
    before = {n: metric(d, n) for n in ("rlserve:kv_transfer_tokens_total", "rlserve:prompt_tokens_computed_total")}
    greedy = prompts(1, lengths)
    for prompt in greedy:
        warm(single, prompt)
        routed = completion(pd["public"], prompt)
        assert routed["kv_transfer_params"] is None  # only P's own answer carries it
        same_choice(routed["choices"][0], completion(single, prompt)["choices"][0])
    transferred = sum((n - 1) // BLOCK * BLOCK for n in lengths)
    assert metric(d, "rlserve:kv_transfer_tokens_total") - before["rlserve:kv_transfer_tokens_total"] == transferred
    computed = metric(d, "rlserve:prompt_tokens_computed_total") - before["rlserve:prompt_tokens_computed_total"]
    assert computed == sum(lengths) - transferred  # only the last partial block (>= 1 token) per prompt
    # seeded samples, all three generation routes, streamed and not
    for prompt in prompts(2, [50, 90]):
        warm(single, prompt)
        sampled = {"temperature": 1.0, "seed": 7, "max_tokens": 12}
        same_choice(
            completion(pd["public"], prompt, **sampled)["choices"][0],
            completion(single, prompt, **sampled)["choices"][0],
        )
        body = {"token_ids": prompt, "sampling_params": {"max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 0}}
        routed, direct = (
            httpx.post(f"{u}/inference/v1/generate", json=body, timeout=120).json() for u in (pd["public"], single)
        )
        assert routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        got = [c["logprob"] for c in routed["choices"][0]["logprobs"]["content"]]
        want = [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]]
        assert close(got, want)
        streamed = _stream_tokens(pd["public"], prompt)
        assert streamed == completion(single, prompt, max_tokens=6)["choices"][0]["token_ids"]
    wait_for(lambda: pinned(pd["p"]) == 0, 120, "P to free every pinned block")
    assert metric(pd["p"], "vllm:kv_cache_usage_perc") == 0
    assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == 0


def _stream_tokens(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": True, "return_token_ids": True}
    tokens = []
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
    return tokens


def test_multi_turn_chat_equals_a_single_server(pd, single):
    messages = [{"role": "user", "content": "tell me a long story about the sea " * 6}]
    for turn in range(3):
        body = {"messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": True, "return_token_ids": True}
        routed = httpx.post(
            f"{pd['public']}/v1/chat/completions", json=body, headers={"X-Session-ID": "s1"}, timeout=120
        ).json()
        httpx.post(f"{single}/v1/chat/completions", json=body | {"max_tokens": 1}, timeout=120)  # see warm()
        direct = httpx.post(f"{single}/v1/chat/completions", json=body, timeout=120).json()
        assert routed["choices"][0]["token_ids"] == direct["choices"][0]["token_ids"]
        got = [c["logprob"] for c in routed["choices"][0]["logprobs"]["content"]]
        want = [c["logprob"] for c in direct["choices"][0]["logprobs"]["content"]]
        assert close(got, want)
        messages += [
            {"role": "assistant", "content": routed["choices"][0]["message"]["content"]},
            {"role": "user", "content": f"and then, part {turn + 2}?"},
        ]
    wait_for(lambda: pinned(pd["p"]) == 0, 120, "P to free every pinned block")


def test_kv_transfer_params_top_level_or_in_extra_args_and_echoed(pd, single):
    p, d = pd["p"], pd["d"]
    (prompt,) = prompts(3, [70])
    plain = httpx.post(
        f"{p}/inference/v1/generate", json={"token_ids": prompt, "sampling_params": {"max_tokens": 2}}, timeout=120
    ).json()
    assert plain["kv_transfer_params"] is None
    body = {
        "token_ids": prompt,
        "sampling_params": {
            "max_tokens": 1,
            "temperature": 0,
            "extra_args": {"kv_transfer_params": {"do_remote_decode": True}},
        },
    }
    kt = httpx.post(f"{p}/inference/v1/generate", json=body, timeout=120).json()["kv_transfer_params"]
    assert kt["do_remote_prefill"] is True and kt["block_size"] == BLOCK and len(kt["remote_block_ids"]) == 70 // BLOCK
    assert pinned(p) == len(kt["remote_block_ids"])
    warm(single, prompt)
    got = httpx.post(
        f"{d}/inference/v1/generate",
        timeout=120,
        json={
            "token_ids": prompt,
            "sampling_params": {
                "max_tokens": 5,
                "temperature": 0,
                "logprobs": 0,
                "extra_args": {"kv_transfer_params": kt},
            },
        },
    ).json()
    want = httpx.post(
        f"{single}/inference/v1/generate",
        timeout=120,
        json={"token_ids": prompt, "sampling_params": {"max_tokens": 5, "temperature": 0, "logprobs": 0}},
    ).json()
    assert got["choices"][0]["token_ids"] == want["choices"][0]["token_ids"]
    assert got["kv_transfer_params"] is None
    wait_for(lambda: pinned(p) == 0, 120, "P to free the pulled blocks")
    # a release for a transfer already freed is harmless: the same params again prefill locally
    again = httpx.post(
        f"{d}/v1/completions", json={"prompt": prompt, "max_tokens": 2, "kv_transfer_params": kt}, timeout=120
    )
    assert again.status_code == 200
    bad = httpx.post(f"{d}/v1/completions", json={"prompt": prompt, "kv_transfer_params": "yes"}, timeout=30)
    assert bad.status_code == 400 and "kv_transfer_params" in bad.text
    bad = httpx.post(f"{d}/inference/v1/generate", timeout=30, json={"token_ids": prompt, "kv_transfer_params": [1]})
    assert bad.status_code == 400 and "kv_transfer_params" in bad.text


def test_structured_outputs_through_prefill_and_decode(pd, single):
    """P samples the first token under the grammar, D carries on from its own grammar state: the text
    matches the constraint and equals the single server's."""
    (prompt,) = prompts(17, [24])
    warm(single, prompt)
    regex = r"[a-f]{3,6}-[0-9]{2}"
    got = completion(pd["public"], prompt, max_tokens=20, guided_regex=regex)["choices"][0]
    want = completion(single, prompt, max_tokens=20, guided_regex=regex)["choices"][0]
    assert re.fullmatch(regex, got["text"]), got["text"]
    same_choice(got, want)


def test_client_abort_mid_decode_frees_p_and_d(pd):
    (prompt,) = prompts(4, [120])
    aborted = metric(pd["d"], "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": prompt, "max_tokens": 380, "ignore_eos": True, "temperature": 0, "stream": True}
    # mid-decode by construction: both replicas paused; one step each lets P prefill, and once D holds the request,
    # two more let D decode its first tokens and freeze it again, so the client leaves a request still running
    assert httpx.post(f"{pd['admin']}/pause", params={"mode": "keep"}, timeout=60).status_code == 200

    def client_leaving_after_the_first_token() -> int:
        with httpx.stream("POST", f"{pd['public']}/v1/completions", json=body, timeout=120) as r:
            assert any(line.startswith("data: {") for line in r.iter_lines())
            return r.status_code  # leaving the block closes the connection mid-stream

    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            left = pool.submit(client_leaving_after_the_first_token)
            wait_for(lambda: metric(pd["p"], "vllm:num_requests_waiting") == 1, 120, "P to queue the request")
            assert httpx.post(f"{pd['admin']}/resume", params={"steps": 1}, timeout=120).status_code == 200
            wait_for(lambda: metric(pd["d"], "vllm:num_requests_waiting") == 1, 120, "D to queue the request")
            assert httpx.post(f"{pd['admin']}/resume", params={"steps": 2}, timeout=120).status_code == 200
            assert left.result(timeout=120) == 200
        wait_for(
            lambda: metric(pd["d"], "vllm:request_success_total", finished_reason="abort") > aborted,
            120,
            "D to abort the request the client left",
        )
    finally:
        assert httpx.post(f"{pd['admin']}/resume", timeout=60).status_code == 200
    wait_for(
        lambda: metric(pd["d"], "vllm:kv_cache_usage_perc") == 0 or metric(pd["d"], "vllm:num_requests_running") == 0,
        120,
        "D to free the request",
    )
    wait_for(
        lambda: pinned(pd["p"]) == 0 and metric(pd["p"], "vllm:kv_cache_usage_perc") == 0,
        120,
        "P's pinned blocks to return to free",
    )


def test_weight_update_between_prefill_and_pull_makes_d_recompute(pd, single, root):
    p, d = pd["p"], pd["d"]
    (prompt,) = prompts(5, [90])
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0, "kv_transfer_params": {"do_remote_decode": True}}
    kt = httpx.post(f"{p}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
    step1 = make_model("tiny", root / "step-1", seed=1)
    r = httpx.post(f"{pd['admin']}/update_weights", json={"weight_dir": str(step1)}, timeout=300)
    assert r.status_code == 200, r.text
    assert httpx.post(f"{single}/update_weights", json={"weight_dir": str(step1)}, timeout=300).status_code == 200
    fallbacks, pulled = (
        metric(d, n) for n in ("rlserve:kv_transfer_local_fallbacks_total", "rlserve:kv_transfer_tokens_total")
    )
    computed = metric(d, "rlserve:prompt_tokens_computed_total")
    got = completion(d, prompt, kv_transfer_params=kt)
    assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == fallbacks + 1
    assert metric(d, "rlserve:kv_transfer_tokens_total") == pulled
    assert metric(d, "rlserve:prompt_tokens_computed_total") - computed == len(prompt)  # recomputed, all of it
    same_choice(got["choices"][0], completion(single, prompt)["choices"][0])  # the new weights' output
    assert got["choices"][0]["policy_version"] == 1
    wait_for(lambda: pinned(p) == 0, 120, "P to free the transfer D declined")
    # and through the router, after the update, transfers resume under the new weights
    (fresh,) = prompts(6, [60])
    warm(single, fresh)
    before = metric(d, "rlserve:kv_transfer_tokens_total")
    same_choice(completion(pd["public"], fresh)["choices"][0], completion(single, fresh)["choices"][0])
    assert metric(d, "rlserve:kv_transfer_tokens_total") - before == (60 - 1) // BLOCK * BLOCK


def test_p_frees_pinned_blocks_when_d_is_killed(pd):
    p = pd["p"]
    (prompt,) = prompts(7, [100])
    expired = metric(p, "rlserve:kv_transfer_expired_total")
    body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    kt = httpx.post(f"{p}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
    assert pinned(p) == len(kt["remote_block_ids"]) > 0
    os.kill(pd["d_pid"], signal.SIGKILL)  # the decode server that would have pulled is gone
    wait_for(lambda: pinned(p) == 0, 120 + PIN_TIMEOUT_S, "P's pin to time out")
    assert metric(p, "rlserve:kv_transfer_expired_total") == expired + 1
    assert metric(p, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="P and D get a core each only with 2 usable cores")
def test_p_and_d_run_on_their_own_cores_across_a_restart(pd):
    """Unbound, the kernel runs a pull's sender and receiver on one core (a loopback wakeup pulls them together);
    each replica's process tree is bound to its own cores, and a restarted D gets the same ones."""
    wait_for(lambda: all(r["status"] == "serving" for r in replicas(pd["admin"])), 300, "D to be restarted")
    rows = sorted(replicas(pd["admin"]), key=lambda r: r["index"])
    assert rows[1]["pid"] != pd["d_pid"]  # the D killed above came back as a new process
    cores = []
    for row in rows:
        tree = [row["pid"], *descendants(row["pid"])]
        assert len(tree) >= 2  # the API server and its engine-core process
        (mine,) = {frozenset(os.sched_getaffinity(pid)) for pid in tree}
        cores.append(mine)
    usable = sorted(os.sched_getaffinity(0))
    half = len(usable) // 2
    assert cores == [frozenset(usable[:half]), frozenset(usable[half : 2 * half])]


def test_sigterm_leaves_no_process(pd):
    proc = pd["proc"]
    wait_for(lambda: all(r["status"] == "serving" for r in replicas(pd["admin"])), 300, "D to be restarted")
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # the prefill and decode servers and the router
    sigterm_leaves_nothing(proc, tree, 30, "every child to exit")


def test_in_thread_engines_transfer_too():
    """`engine.core_process = false`: the engine steps in the API server's process; P and D driven directly."""
    args = ("--engine.core_process", "false", "--engine.kv_cache_bytes", str(16 << 20), "--kv_transfer.port", "0")
    (p, p_proc), (d, d_proc) = start_server(*args), start_server(*args)
    try:
        (prompt,) = prompts(8, [100])
        body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        kt = httpx.post(f"{p}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
        warm(p, prompt)  # P now holds the prompt's KV twice over: its own warm answer is the reference
        same_choice(completion(d, prompt, kv_transfer_params=kt)["choices"][0], completion(p, prompt)["choices"][0])
        assert metric(d, "rlserve:kv_transfer_tokens_total") == (100 - 1) // BLOCK * BLOCK
        wait_for(lambda: pinned(p) == 0, 120, "P to free the pulled blocks")
    finally:
        stop_server(p_proc)
        stop_server(d_proc)
