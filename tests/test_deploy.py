"""A deployment of two replicas behind the real vllm-router: session affinity, fields unchanged through
the router, one admin address for both replicas (updates, refusals, a trainer push), a replica killed
with requests in flight, and SIGTERM leaving no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy_helpers import descendants, replicas, sigterm_leaves_nothing, two_replicas_under, wait_for
from rlserve.client import SyncInferenceClient
from rlserve.model.make import make_model
from test_server_rl import TRAINER, choice_lps, generate, hf_check, trainer_push

PROMPTS = [[11, 22, 33, 44, 55], [100, 7, 300, 9]]


@pytest.fixture(scope="module")
def deployment(root):
    # exec'd replicas: tests here take the deployment's key from a replica's /proc/PID/environ, which holds the
    # environment a process was exec'd with (a forked replica's is the preloaded process's)
    with two_replicas_under(root, "--deployment.fork_replicas", "false") as running:
        yield running


def served(url: str, http: httpx.Client | None = None) -> float:
    """Requests this replica finished, from its own Prometheus metrics (through `http` where given: a one-off
    httpx.get builds a client, and its TLS context, each call)."""
    text = (http or httpx).get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        if f.name == "vllm:request_success"
        for s in f.samples
        if s.name.endswith("_total")
    )


def serving_urls(admin: str) -> list[str]:
    return [r["url"] for r in replicas(admin) if r["status"] == "serving"]


def test_sessions_stick_to_one_replica_and_fields_pass_unchanged(deployment):
    public, admin, _ = deployment
    urls = serving_urls(admin)
    assert len(urls) == 2
    home: dict[int, set[str]] = {}
    with httpx.Client(timeout=60) as http:
        counts = {u: served(u, http) for u in urls}
        for turn in range(4):
            for session in range(32):
                body = {"prompt": [session + 1, turn + 1], "max_tokens": 1, "temperature": 0}
                r = http.post(f"{public}/v1/completions", json=body, headers={"X-Session-ID": f"traj-{session}"})
                assert r.status_code == 200, r.text
                now = {u: served(u, http) for u in urls}
                (landed,) = [u for u in urls if now[u] == counts[u] + 1]
                counts = now
                home.setdefault(session, set()).add(landed)
    assert all(len(places) == 1 for places in home.values())
    assert {next(iter(p)) for p in home.values()} == set(urls)  # both replicas got sessions
    # what a client reads arrives through the router exactly as the replica sends it
    for prompt in PROMPTS:
        direct = [generate(u, prompt, top_logprobs=2)["choices"][0] for u in urls]
        routed = generate(public, prompt, top_logprobs=2)["choices"][0]
        for d in direct:
            for key in ("token_ids", "logprobs", "policy_version", "weight_version", "weight_versions"):
                assert routed[key] == d[key]


def test_router_facing_routes_answer(deployment):
    public, admin, _ = deployment
    loads = httpx.get(f"{public}/get_loads", timeout=30).json()["workers"]
    assert sorted(w["worker"] for w in loads) == sorted(serving_urls(admin)) and all(w["load"] >= 0 for w in loads)
    assert httpx.get(f"{public}/health_generate", timeout=60).status_code == 200
    assert httpx.get(f"{public}/get_server_info", timeout=30).json()["policy_version"] == 0


def test_admin_calls_only_through_the_admin_address(deployment, root):
    public, admin, _ = deployment
    for url in [public, *serving_urls(admin)]:
        r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(root)}, timeout=60)
        assert r.status_code == 403 and admin in r.json()["error"]["message"]
    r = httpx.post(f"{admin}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert r.status_code == 404 and public in r.json()["error"]["message"]


def test_one_update_reaches_both_replicas_and_a_corrupt_one_none(deployment, root):
    public, admin, _ = deployment
    step1 = make_model("tiny", root / "step-1", seed=1)
    client = SyncInferenceClient(public, admin_url=admin)
    try:
        versions = client.update_weights(str(step1), weight_version="step-1")
        assert list(versions.values()) == [1]
        sample = client.generate(token_ids=PROMPTS[0], max_tokens=4, temperature=0)
        assert sample.policy_version == 1 and sample.endpoint == public
    finally:
        client.close()
    urls = serving_urls(admin)
    for url in urls:
        for prompt in PROMPTS:
            choice = generate(url, prompt)["choices"][0]
            assert choice["policy_version"] == 1 and choice["weight_version"] == "step-1"
            hf_check(step1, prompt, choice)
    before = {u: generate(u, PROMPTS[1])["choices"][0] for u in urls}
    bad = make_model("tiny", root / "bad", seed=2)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(bad)}, timeout=120)
    assert r.status_code == 400 and "previous weights keep serving" in r.json()["error"]["message"]
    assert serving_urls(admin) == urls  # refused by all: nobody leaves the rotation
    for url in urls:
        after = generate(url, PROMPTS[1])["choices"][0]
        assert after["policy_version"] == 1
        assert after["token_ids"] == before[url]["token_ids"] and choice_lps(after) == choice_lps(before[url])


def test_kill_9_with_64_requests_in_flight(deployment, root):
    public, admin, _ = deployment
    victim = replicas(admin)[1]
    httpx.post(f"{admin}/pause", params={"mode": "keep"}, timeout=60).raise_for_status()

    async def scenario():
        async with httpx.AsyncClient(timeout=600) as http:

            async def one(i):
                body = {
                    "token_ids": [i + 1, 5, 9],
                    "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 0, "ignore_eos": True},
                }
                return await http.post(
                    f"{public}/inference/v1/generate", json=body, headers={"X-Session-ID": f"kill-{i}"}
                )

            tasks = [asyncio.ensure_future(one(i)) for i in range(64)]
            # held by the pause on both replicas: all 64 are in flight when the replica dies
            await asyncio.to_thread(
                wait_for,
                lambda: sum(r.get("waiting", 0) + r.get("running", 0) for r in replicas(admin)) == 64,
                300,
                "64 queued requests",
            )
            os.kill(victim["pid"], signal.SIGKILL)
            await asyncio.to_thread(wait_for, lambda: victim["url"] not in serving_urls(admin), 60, "eviction")
            (await http.post(f"{admin}/resume")).raise_for_status()
            return await asyncio.gather(*tasks)

    results = asyncio.run(scenario())
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200][:3]
    assert all(len(r.json()["choices"][0]["token_ids"]) == 8 for r in results)
    # restarted, replayed to the deployment's weights, back in the rotation
    rows = wait_for(
        lambda: [
            r
            for r in replicas(admin)
            if r["status"] == "serving" and r["index"] == victim["index"] and r["restarts"] == 1
        ],
        600,
        "the restart",
    )
    assert rows[0]["policy_version"] == 1 and rows[0]["weight_version"] == "step-1"
    hf_check(root / "step-1", PROMPTS[0], generate(rows[0]["url"], PROMPTS[0])["choices"][0])


def test_a_replica_that_fails_an_admin_call_leaves_and_rejoins(deployment, peft_adapter):
    """Drift made by hand (with the key the supervisor gave it): only one replica has the adapter, and so a
    policy_version the others do not. Loading it through the admin address is all-or-none: that replica
    refuses (already loaded), the other unloads it again, and the drifted one (its versions differ from
    the deployment's record) leaves, restarts and rejoins at the record: base weights, versions, no adapter."""
    public, admin, _ = deployment
    path, _ = peft_adapter
    odd = replicas(admin)[1]
    (other,) = [row for row in replicas(admin) if row["index"] != odd["index"]]
    before = (other["policy_version"], other["weight_version"])
    key = _environ(odd["pid"])["RLSERVE_DEPLOYMENT_KEY"]
    body = {"lora_name": "drift", "lora_path": str(path)}
    r = httpx.post(f"{odd['url']}/v1/load_lora_adapter", json=body, headers={"x-rlserve-deployment-key": key})
    assert r.status_code == 200, r.text
    r = httpx.post(f"{admin}/v1/load_lora_adapter", json=body, timeout=120)
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and f"replica {odd['index']} ({odd['url']})" in message and "Nothing changed" in message
    (row,) = [row for row in replicas(admin) if row["index"] == other["index"]]
    assert row["status"] == "serving" and (row["policy_version"], row["weight_version"]) == before
    back = wait_for(
        lambda: [
            r
            for r in replicas(admin)
            if r["index"] == odd["index"] and r["status"] == "serving" and r["restarts"] == odd["restarts"] + 1
        ],
        600,
        "the rejoin",
    )[0]
    assert (back["policy_version"], back["weight_version"]) == before
    for url in serving_urls(admin):
        assert "drift" not in [m["id"] for m in httpx.get(f"{url}/v1/models", timeout=30).json()["data"]]
    served = [generate(u, PROMPTS[0], max_tokens=4) for u in serving_urls(admin)]
    assert len(served) == 2 and served[0]["choices"][0]["token_ids"] == served[1]["choices"][0]["token_ids"]


def _environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        return dict(item.decode().split("=", 1) for item in f.read().split(b"\0") if b"=" in item)


def test_a_trainer_push_reaches_both_replicas(deployment, root):
    public, admin, _ = deployment
    pushed = make_model("tiny", root / "pushed", seed=4)
    no_admin_key = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")
    version = replicas(admin)[0]["policy_version"] + 1
    assert trainer_push(admin, pushed, timeout=300, trainer=no_admin_key) == [version]
    for url in serving_urls(admin):
        choice = generate(url, PROMPTS[0])["choices"][0]
        assert choice["policy_version"] == version and choice["weight_version"] == "step-7"
        hf_check(pushed, PROMPTS[0], choice)


def test_a_dead_router_is_restarted_on_the_same_url(deployment):
    public, admin, _ = deployment
    old = httpx.get(f"{admin}/deployment", timeout=30).json()["router_pid"]
    os.kill(old, signal.SIGKILL)

    def answers() -> bool:
        try:
            return (
                httpx.post(f"{public}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, timeout=30).status_code
                == 200
            )
        except httpx.HTTPError:
            return False

    wait_for(answers, 120, "the router to come back")
    assert httpx.get(f"{admin}/deployment", timeout=30).json()["router_pid"] != old


def test_sigterm_leaves_no_process(deployment):
    """Nor the replicas' engine socket directories: each replica stops by itself on the SIGTERM its process
    group gets (its engine process gets it too), not by the supervisor's SIGKILL after the grace period."""
    _, _, proc = deployment
    tree = descendants(proc.pid)
    assert len(tree) >= 3  # two replicas and the router
    socket_dirs = {
        Path(arg[len("ipc://") :]).parent for pid in tree for arg in _cmdline(pid) if arg.startswith("ipc://")
    }
    assert len(socket_dirs) == 2 and all(d.is_dir() for d in socket_dirs)  # one per replica's engine process
    sigterm_leaves_nothing(proc, tree, 30, "every child to exit")
    assert not [d for d in socket_dirs if d.exists()]


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").replace("\0", " ").split()
    except OSError:
        return []
