"""A 2-replica deployment where an update from disk fails on one replica mid-way, once by a bad checkpoint
and once by the replica being killed (and a LoRA adapter load, by a bad adapter): the update is all-or-none (both replicas keep or are restored to the
previous weights and versions, and the admin call names the replica that failed), one retry brings both to
the new version, and the killed replica restarts with the deployment's current weights before the router
sends it traffic.

Throughout, greedy one-token requests run through the router, and every answer's token and logprob must be
what transformers gives for the weights its label names: no answer ever carries the new label with the old
weights or the reverse. "Mid-way" is made true by construction: replica 1's server is frozen (SIGSTOP)
before the admin call, replica 0 is seen to have applied the update, and only then is the checkpoint
corrupted (then SIGCONT) or replica 1 killed. Only processes this test started are signalled, by PID."""

from __future__ import annotations

import os
import shutil
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from deploy_helpers import QUICK_PROBES, descendants, replicas, two_replicas_under, wait_for
from rlserve.model.make import make_model
from test_deploy import served
from test_server_rl import generate, hf_check

PROMPTS = [[11, 22, 33, 44, 55], [100, 7, 300, 9], [5, 6, 7], [250, 251, 252, 253, 254, 255]]
SEEDS = {"step-1": 1, "step-2": 2, "step-3": 3}
HELD, HELD_TOKENS, AROUND = 8, 16, 12


@pytest.fixture(scope="module")
def weights(root):
    return {label: make_model("tiny", root / label, seed=seed) for label, seed in SEEDS.items()}


@pytest.fixture(scope="module")
def expected(weights):
    """label -> prompt index -> (greedy token, its logprob) under that label's weights."""
    return {label: greedy_rows(path) for label, path in weights.items()}


def greedy_rows(model_dir) -> list[tuple[int, float]]:
    """Per prompt of PROMPTS: transformers' greedy token and its logprob under these weights."""
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for prompt in PROMPTS:
            lp = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
            token = int(lp.argmax())
            rows.append((token, float(lp[token])))
    return rows


@pytest.fixture(scope="module")
def deployment(root, weights):
    with two_replicas_under(root) as (public, admin, proc):
        r = httpx.post(
            f"{admin}/update_weights",
            json={"weight_dir": str(weights["step-1"]), "weight_version": "step-1"},
            timeout=300,
        )
        assert r.status_code == 200, r.text
        yield public, admin, proc


@pytest.fixture(scope="module")
def probed(root, weights):
    """A deployment for the tests that wait for a frozen replica to be taken out and readmitted: its supervisor
    gives a probe 3 s (not 10 s) and a readmission 10 s (not 30 s), so those waits are a third as long. The
    other tests keep the defaults: their short freezes must not be taken for a replica that stopped answering.
    At step-1's weights, so that a restarted replica must be brought to them."""
    with two_replicas_under(root, *QUICK_PROBES) as (public, admin, proc):
        r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(weights["step-1"])}, timeout=300)
        assert r.status_code == 200, r.text
        yield public, admin, proc


class Load:
    """Greedy one-token requests through the router until stopped; every answer is kept."""

    def __init__(self, public: str, workers: int = 2):
        self.public, self.stop, self.answers = public, threading.Event(), []
        self.pool = ThreadPoolExecutor(workers)
        self.futures = [self.pool.submit(self._run, w) for w in range(workers)]

    def _run(self, worker: int) -> None:
        with httpx.Client(timeout=600) as http:
            i = 0
            while not self.stop.is_set():
                p = (worker + i) % len(PROMPTS)
                body = {"token_ids": PROMPTS[p], "sampling_params": {"temperature": 0, "max_tokens": 1, "logprobs": 0}}
                r = http.post(
                    f"{self.public}/inference/v1/generate", json=body, headers={"X-Session-ID": f"load-{worker}-{i}"}
                )
                self.answers.append((p, r.status_code, r.json() if r.status_code == 200 else r.text))
                i += 1

    def __enter__(self) -> Load:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()  # a failing test must not leave the threads running

    def finish(self) -> list:
        self.stop.set()
        for f in self.futures:
            f.result()
        self.pool.shutdown()
        return self.answers


def check_labels_match_weights(answers: list, expected: dict) -> set[str]:
    """Every answer is a 200 whose token and logprob are those of the weights its label names."""
    labels = set()
    for p, status, data in answers:
        assert status == 200, data
        choice = data["choices"][0]
        label = choice["weight_version"]
        assert label in expected, f"an answer labelled {label!r}: weights the deployment never had at that label"
        token, logprob = expected[label][p]
        assert choice["token_ids"] == [token], (label, choice["policy_version"])
        assert abs(choice["logprobs"]["content"][0]["logprob"] - logprob) <= 1e-4, (label, choice["policy_version"])
        labels.add(label)
    return labels


def versions(url: str) -> tuple[int, str]:
    data = httpx.get(f"{url}/get_weight_version", timeout=30).json()
    return data["policy_version"], data["weight_version"]


def start_update(admin: str, weight_dir, label: str):
    pool = ThreadPoolExecutor(1)
    body = {"weight_dir": str(weight_dir), "weight_version": label}
    future = pool.submit(httpx.post, f"{admin}/update_weights", json=body, timeout=600)
    pool.shutdown(wait=False)
    return future


def all_serving_at(admin: str, version: tuple[int, str], weights_dir) -> list[dict]:
    # a replica frozen long enough is out of the rotation for a moment: it comes back by itself
    rows = wait_for(
        lambda: (rows := replicas(admin)) and all(r["status"] == "serving" for r in rows) and rows, 120, "both serving"
    )
    for row in rows:
        assert versions(row["url"]) == version
        for prompt in PROMPTS[:2]:
            choice = generate(row["url"], prompt, max_tokens=4)["choices"][0]
            assert (choice["policy_version"], choice["weight_version"]) == version
            hf_check(weights_dir, prompt, choice)
    return rows


def test_a_bad_checkpoint_on_one_replica_changes_no_replica(deployment, weights, expected):
    public, admin, _ = deployment
    first, frozen = replicas(admin)
    candidate = weights["step-2"]
    good = (candidate / "model.safetensors").read_bytes()
    with Load(public) as load:
        os.kill(frozen["pid"], signal.SIGSTOP)
        try:
            update = start_update(admin, candidate, "step-2")
            wait_for(lambda: versions(first["url"]) == (2, "step-2"), 300, "replica 0 to apply the update")
            (candidate / "model.safetensors").write_bytes(good[: len(good) // 3])  # what replica 1 will read
        finally:
            os.kill(frozen["pid"], signal.SIGCONT)
        check_bad_then_retry(admin, update, first, frozen, weights, good)
        answers = load.finish()
    assert check_labels_match_weights(answers, expected) >= {"step-1", "step-2"}


def check_bad_then_retry(admin, update, first, frozen, weights, good) -> None:
    candidate = weights["step-2"]
    r = update.result()
    message = r.json()["error"]["message"]
    assert r.status_code == 400, r.text
    assert f"replica 1 ({frozen['url']})" in message and "Nothing changed" in message
    rows = all_serving_at(admin, (1, "step-1"), weights["step-1"])
    assert [row["restarts"] for row in rows] == [first["restarts"], frozen["restarts"]]  # restored, not restarted

    (candidate / "model.safetensors").write_bytes(good)
    r = httpx.post(
        f"{admin}/update_weights", json={"weight_dir": str(candidate), "weight_version": "step-2"}, timeout=300
    )
    assert r.status_code == 200, r.text
    all_serving_at(admin, (2, "step-2"), candidate)


def test_a_replica_killed_mid_update_restarts_at_the_previous_weights(deployment, weights, expected):
    public, admin, _ = deployment
    first, victim = replicas(admin)
    with Load(public) as load:
        kill_mid_update_then_retry(admin, first, victim, weights)
        answers = load.finish()
    assert check_labels_match_weights(answers, expected) >= {"step-2", "step-3"}


def kill_mid_update_then_retry(admin, first, victim, weights) -> None:
    os.kill(victim["pid"], signal.SIGSTOP)
    update = start_update(admin, weights["step-3"], "step-3")
    wait_for(lambda: versions(first["url"]) == (3, "step-3"), 300, "replica 0 to apply the update")
    os.kill(victim["pid"], signal.SIGKILL)
    r = update.result()
    message = r.json()["error"]["message"]
    assert r.status_code == 502 and f"replica 1 ({victim['url']})" in message and "Nothing changed" in message
    assert versions(first["url"]) == (2, "step-2")  # restored before the call answered
    # restarted, replayed to the deployment's weights, and only then back in the router's rotation: the
    # load above never sees the fresh process's startup weights (their label is not in `expected`)
    wait_for(
        lambda: [r for r in replicas(admin) if r["status"] == "serving" and r["restarts"] == victim["restarts"] + 1],
        600,
        "replica 1 to rejoin",
    )
    all_serving_at(admin, (2, "step-2"), weights["step-2"])

    r = httpx.post(
        f"{admin}/update_weights", json={"weight_dir": str(weights["step-3"]), "weight_version": "step-3"}, timeout=300
    )
    assert r.status_code == 200, r.text
    all_serving_at(admin, (3, "step-3"), weights["step-3"])


def freeze(pid: int, sig: signal.Signals) -> None:
    """The replica's whole process tree (its server and its engine process), which this test started."""
    for p in [pid, *descendants(pid)]:
        os.kill(p, sig)


def post_held(public: str, i: int) -> httpx.Response:
    body = {
        "token_ids": [i + 1, 5, 9],
        "sampling_params": {"max_tokens": HELD_TOKENS, "temperature": 0, "logprobs": 0, "ignore_eos": True},
    }
    return httpx.post(f"{public}/inference/v1/generate", json=body, headers={"X-Session-ID": f"held-{i}"}, timeout=600)


def test_a_frozen_replica_is_routed_around_and_its_requests_finish_once_it_resumes(probed):
    """SIGSTOP under load: the frozen replica holds requests (made true by a deployment pause), leaves the
    rotation while frozen, every request sent meanwhile is served by the other, the held ones finish after
    SIGCONT, and the replicas' own request counters add up to exactly what the clients received."""
    public, admin, _ = probed
    rows = wait_for(lambda: (r := replicas(admin)) and all(x["status"] == "serving" for x in r) and r, 120, "serving")
    before = {row["index"]: served(row["url"]) for row in rows}
    httpx.post(f"{admin}/pause", params={"mode": "keep"}, timeout=120).raise_for_status()
    pool = ThreadPoolExecutor(HELD)
    held = [pool.submit(post_held, public, i) for i in range(HELD)]
    try:
        rows = wait_for(
            lambda: (r := replicas(admin)) and sum(x["running"] + x["waiting"] for x in r) == HELD and r, 300, "held"
        )
        victim = max(rows, key=lambda x: x["running"] + x["waiting"])
        (other,) = [x for x in rows if x["index"] != victim["index"]]
        on_victim = victim["running"] + victim["waiting"]
        freeze(victim["pid"], signal.SIGSTOP)
        try:
            out = wait_for(
                lambda: (r := replicas_by_index(admin)[victim["index"]])["status"] == "unresponsive" and r, 120, "out"
            )
            assert "3 /health probes in a row (3 s each)" in out["detail"]  # QUICK_PROBES reached the supervisor
            assert victim["url"] not in httpx.get(f"{public}/list_workers", timeout=30).json()["urls"]
            httpx.post(f"{admin}/resume", timeout=120).raise_for_status()  # reaches the serving replica only
            for i in range(AROUND):  # while the victim is frozen: every one of these is served by the other
                r = httpx.post(
                    f"{public}/v1/completions",
                    json={"prompt": [i + 1, 2], "max_tokens": 2, "temperature": 0},
                    headers={"X-Session-ID": f"around-{i}"},
                    timeout=120,
                )
                assert r.status_code == 200, r.text
            expected_other = HELD - on_victim + AROUND
            wait_for(lambda: served(other["url"]) - before[other["index"]] == expected_other, 300, "the other's")
        finally:
            freeze(victim["pid"], signal.SIGCONT)
        results = [f.result() for f in held]  # the victim's finish once it is back (and resumed)
    finally:
        pool.shutdown(wait=False)
    assert all(r.status_code == 200 for r in results), [r.text for r in results if r.status_code != 200]
    assert all(len(r.json()["choices"][0]["token_ids"]) == HELD_TOKENS for r in results)
    wait_for(lambda: replicas_by_index(admin)[victim["index"]]["status"] == "serving", 120, "the victim back")
    assert replicas_by_index(admin)[victim["index"]]["restarts"] == victim["restarts"]  # never restarted
    # nothing counted twice: each replica finished exactly the requests the clients got from it
    assert served(victim["url"]) - before[victim["index"]] == on_victim
    assert served(other["url"]) - before[other["index"]] == HELD - on_victim + AROUND


def replicas_by_index(admin: str) -> dict[int, dict]:
    return {row["index"]: row for row in replicas(admin)}


def adapter_answer(url: str, name: str) -> tuple[str, list[float]]:
    body = {"model": name, "prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "logprobs": 1}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"], choice["logprobs"]["token_logprobs"]


def same_answers(a: tuple[str, list[float]], b: tuple[str, list[float]]) -> bool:
    return a[0] == b[0] and all(abs(x - y) <= 1e-5 for x, y in zip(a[1], b[1], strict=True))


def load_refused_by_replica_1(admin: str, first: dict, frozen: dict, route: str, body: dict, adapter_dir):
    """Replica 0 loads the adapter; only then is its file corrupted, and replica 1 (frozen till now) reads that."""
    weights_file = adapter_dir / "adapter_model.safetensors"
    good, start = weights_file.read_bytes(), versions(first["url"])
    os.kill(frozen["pid"], signal.SIGSTOP)
    try:
        pool = ThreadPoolExecutor(1)
        future = pool.submit(httpx.post, f"{admin}{route}", json=body, timeout=600)
        pool.shutdown(wait=False)
        wait_for(lambda: versions(first["url"])[0] == start[0] + 1, 300, "replica 0 to load the adapter")
        weights_file.write_bytes(good[: len(good) // 3])
    finally:
        os.kill(frozen["pid"], signal.SIGCONT)
    r = future.result()
    weights_file.write_bytes(good)
    return r


def test_a_lora_load_refused_by_one_replica_is_taken_back_on_the_other(deployment, peft_adapter, root):
    """All-or-none for adapters: a new name is unloaded again where it was loaded, a name loaded again in
    place goes back to its previous adapter, the versions go back, and a retry loads it on both."""
    _, admin, _ = deployment
    first, frozen = wait_for(lambda: (r := replicas(admin)) and all(x["status"] == "serving" for x in r) and r, 120)
    base = versions(first["url"])
    fresh = root / "adapter-fresh"
    shutil.copytree(peft_adapter[0], fresh, dirs_exist_ok=True)
    body = {"lora_name": "policy", "lora_path": str(fresh)}
    r = load_refused_by_replica_1(admin, first, frozen, "/v1/load_lora_adapter", body, fresh)
    assert r.status_code == 400, r.text
    assert f"replica 1 ({frozen['url']})" in r.json()["error"]["message"] and "Nothing changed" in r.text
    for row in replicas(admin):
        models = httpx.get(f"{row['url']}/v1/models", timeout=30).json()["data"]
        assert "policy" not in [m["id"] for m in models] and versions(row["url"]) == base

    assert httpx.post(f"{admin}/v1/load_lora_adapter", json=body, timeout=300).status_code == 200
    loaded = [adapter_answer(row["url"], "policy") for row in replicas(admin)]
    assert same_answers(*loaded)

    # the same name in place, from a different adapter (its B matrices tripled) that replica 1 reads corrupted
    second = root / "adapter-second"
    shutil.copytree(fresh, second, dirs_exist_ok=True)
    tensors = load_file(fresh / "adapter_model.safetensors")
    save_file({k: v * 3 if "lora_B" in k else v for k, v in tensors.items()}, second / "adapter_model.safetensors")
    before = versions(first["url"])
    body = {"lora_name": "policy", "lora_path": str(second)}
    r = load_refused_by_replica_1(admin, first, frozen, "/load_lora_adapter", body, second)
    assert r.status_code == 400 and "Nothing changed" in r.text, r.text
    rows = replicas(admin)
    assert [row["restarts"] for row in rows] == [first["restarts"], frozen["restarts"]]  # taken back, not restarted
    for row in rows:
        assert versions(row["url"]) == before
        assert same_answers(adapter_answer(row["url"], "policy"), loaded[0])  # the first adapter again
    body = {"lora_name": "policy-second", "lora_path": str(second)}
    assert httpx.post(f"{admin}/v1/load_lora_adapter", json=body, timeout=300).status_code == 200
    assert not same_answers(adapter_answer(first["url"], "policy-second"), loaded[0])  # the check above can fail


def test_a_replica_whose_server_answers_again_but_not_its_engine_is_restarted(probed):
    """Its whole tree frozen (taken out of the rotation), then only the server thawed: /health answers again
    while the engine process stays frozen, so bringing it to the deployment's pause state cannot finish. The
    supervisor gives that health_check.readmit_timeout_s and restarts the replica whole, at the deployment's
    weights; nothing of the frozen tree is left. Before, the call waited forever, holding the deployment's lock
    and the liveness loop, and the replica stayed out of the rotation for good."""
    public, admin, _ = probed
    rows = wait_for(lambda: (r := replicas(admin)) and all(x["status"] == "serving" for x in r) and r, 120, "serving")
    victim, other = rows[1], rows[0]
    tree = [victim["pid"], *descendants(victim["pid"])]
    assert len(tree) > 1  # the server and its engine process
    freeze(victim["pid"], signal.SIGSTOP)
    try:
        wait_for(lambda: replicas_by_index(admin)[victim["index"]]["status"] == "unresponsive", 120, "taken out")
        os.kill(victim["pid"], signal.SIGCONT)  # the server alone: its engine process stays frozen
        row = wait_for(
            lambda: (
                (r := replicas_by_index(admin)[victim["index"]])["status"] == "serving"
                and r["restarts"] == victim["restarts"] + 1
                and r
            ),
            300,
            "the victim restarted and serving",
            lambda: replicas(admin),
        )
    finally:
        for pid in tree:
            if psutil.pid_exists(pid):
                os.kill(pid, signal.SIGCONT)
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie" for pid in tree)
    assert row["url"] != victim["url"] or row["pid"] != victim["pid"]
    assert versions(row["url"]) == versions(other["url"])
    r = httpx.post(f"{public}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text
