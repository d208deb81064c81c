"""Trainer pushes across a 2-replica deployment are replayable and all-or-none, as updates from disk are: after a
push (rlserve's broadcast, and vLLM's weight transfer) one replica writes a copy of the pushed weights, so a
replica killed afterwards restarts and rejoins at the pushed weights and version before the router sends it
traffic; and a push that commits on one replica but fails on the other (killed between the last part and
/finish_weight_update) is taken back on the first, the admin call naming the one that failed, and one retry
brings both to the new version.

While replicas restart, greedy one-token requests run through the router, and every answer's token and
logprob must be those of the weights its label names (test_deploy_faults.py's Load): no answer carries the
pushed label with a fresh process's startup weights. Only processes this test started are killed, by PID."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from test_deploy_faults import PROMPTS, Load, check_labels_match_weights, greedy_rows, versions

from deploy_helpers import rejoined, replicas, two_replicas_under, wait_for
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port
from test_deploy import _environ
from test_server_rl import TRAINER, choice_lps, generate, hf_check, trainer_push

VLLM_TRAINER = str(Path(__file__).parent.parent / "vllm_trainer.py")
BROADCASTER = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")  # pushes with the label "step-7"


@pytest.fixture(scope="module")
def deployment(root):
    # exec'd replicas: tests here take the deployment's key from a replica's /proc/PID/environ, which holds the
    # environment a process was exec'd with (a forked replica's is the preloaded process's)
    with two_replicas_under(root, "--deployment.fork_replicas", "false") as running:
        yield running


def same_answers_everywhere(admin: str, version: tuple[int, str], model_dir: Path) -> None:
    """Every replica serves `version`, with the weights of `model_dir`, and they agree token for token."""
    rows = wait_for(
        lambda: (rows := replicas(admin)) and all(r["status"] == "serving" for r in rows) and rows, 120, "both serving"
    )
    for prompt in PROMPTS[:2]:
        answers = [generate(row["url"], prompt)["choices"][0] for row in rows]
        for choice in answers:
            assert (choice["policy_version"], choice["weight_version"]) == version
            hf_check(model_dir, prompt, choice)
        assert answers[0]["token_ids"] == answers[1]["token_ids"]
        # not bitwise: a replica that served the prompt before computes it after a prefix-cache hit, and on
        # AVX-512 that path sums one row by another routine (~2e-6); different weights part by far more
        first, second = (torch.tensor(choice_lps(choice)) for choice in answers)
        assert torch.allclose(first, second, rtol=0, atol=1e-5)
    for row in rows:
        assert versions(row["url"]) == version


def kill_and_rejoin(admin: str, index: int) -> None:
    (victim,) = [r for r in replicas(admin) if r["index"] == index]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: rejoined(admin, victim), 600, f"replica {index} to rejoin")


def test_a_replica_killed_after_a_broadcast_push_rejoins_at_the_pushed_weights(deployment, root):
    public, admin, _ = deployment
    pushed = make_model("tiny", root / "pushed-7", seed=7)
    version = (replicas(admin)[0]["policy_version"] + 1, "step-7")
    assert trainer_push(admin, pushed, timeout=300, trainer=BROADCASTER) == [version[0]]
    with Load(public, workers=1) as load:
        kill_and_rejoin(admin, 1)
        answers = load.finish()
    assert check_labels_match_weights(answers, {"step-7": greedy_rows(pushed)}) == {"step-7"}
    same_answers_everywhere(admin, version, pushed)


STEADY_TRAINER = textwrap.dedent(
    """
    import json, sys
    from safetensors.torch import load_file
    from rlserve.client.weights import WeightBroadcaster
    url, port = sys.argv[1], int(sys.argv[2])
    with WeightBroadcaster([url], "127.0.0.1", port, bucket_bytes=1 << 20) as b:
        print(json.dumps("joined"), flush=True)
        for line in sys.stdin:  # "checkpoint label" per push; its policy versions back
            ckpt, label = line.split()
            print(json.dumps(b.push(sorted(load_file(ckpt).items()), weight_version=label)), flush=True)
    """
)


def test_a_replica_outside_the_trainers_group_gets_each_push_from_the_copy(deployment, root):
    """The trainer joined while replica 1 was restarting, so its pushes reach replica 0 only: replica 1 leaves
    the rotation, replays the copy of each push and its versions, and comes back, without a restart."""
    public, admin, _ = deployment
    pushed, step_1 = make_model("tiny", root / "pushed-9", seed=9), make_model("tiny", root / "step-1", seed=1)
    r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(step_1), "weight_version": "step-1"}, timeout=300)
    assert r.status_code == 200, r.text
    (victim,) = [r for r in replicas(admin) if r["index"] == 1]
    os.kill(victim["pid"], signal.SIGKILL)
    wait_for(lambda: replicas(admin)[1]["status"] != "serving", 60, "the supervisor to see replica 1 die")
    trainer = subprocess.Popen(
        [sys.executable, "-c", STEADY_TRAINER, admin, str(free_port())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert json.loads(trainer.stdout.readline()) == "joined"
        back = wait_for(lambda: rejoined(admin, victim), 600, "replica 1 to rejoin")
        version = (back["policy_version"] + 1, "step-9")
        with Load(public, workers=1) as load:
            trainer.stdin.write(f"{pushed / 'model.safetensors'} step-9\n")
            trainer.stdin.flush()
            assert json.loads(trainer.stdout.readline()) == [version[0]]
            answers = load.finish()
        trainer.stdin.close()
        assert trainer.wait(timeout=120) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    same_answers_everywhere(admin, version, pushed)
    assert [r["restarts"] for r in replicas(admin)][1] == back["restarts"]  # replayed in place
    expected = {"step-1": greedy_rows(step_1), "step-9": greedy_rows(pushed)}
    assert "step-9" in check_labels_match_weights(answers, expected)


def vllm_push(admin: str, ckpt: Path) -> None:
    """vLLM's weight transfer up to its last part: the group joined, the update opened and every tensor received;
    the test sends /finish_weight_update itself."""
    plan = [["join"], ["push", str(ckpt / "model.safetensors"), {"finish": False, "generate": False}]]
    proc = subprocess.run(
        [sys.executable, VLLM_TRAINER, admin, json.dumps(plan)], capture_output=True, text=True, timeout=600
    )
    steps = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [s["status"] for s in steps] == [200, 200], proc.stderr[-3000:]


def finish(admin: str, label: str) -> httpx.Response:
    return httpx.post(f"{admin}/finish_weight_update", json={"weight_version": label}, timeout=600)


def test_a_vllm_push_that_fails_on_one_replica_is_taken_back_and_a_retry_applies_it(deployment, root):
    public, admin, _ = deployment
    step_1 = make_model("tiny", root / "step-1", seed=1)
    step_8 = make_model("tiny", root / "step-8", seed=8)
    r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(step_1), "weight_version": "step-1"}, timeout=300)
    assert r.status_code == 200, r.text
    old = versions(replicas(admin)[0]["url"])
    expected = {"step-1": greedy_rows(step_1), "step-8": greedy_rows(step_8)}
    with Load(public, workers=1) as load:
        vllm_push(admin, step_8)
        first, victim = replicas(admin)
        # mid-commit by construction: replica 1 (every part received) holds the finish while replica 0 commits
        os.kill(victim["pid"], signal.SIGSTOP)
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(finish, admin, "step-8")
            try:
                wait_for(lambda: versions(first["url"]) == (old[0] + 1, "step-8"), 300, "replica 0 to commit")
            finally:
                os.kill(victim["pid"], signal.SIGKILL)
            r = pending.result()
        message = r.json()["error"]["message"]
        assert r.status_code == 502 and f"replica 1 ({victim['url']})" in message and "Nothing changed" in message
        assert versions(first["url"]) == old  # taken back before the call answered
        wait_for(lambda: rejoined(admin, victim), 600, "replica 1 to rejoin")
        same_answers_everywhere(admin, old, step_1)

        vllm_push(admin, step_8)  # the retry: the restarted replica joins the trainer's new group
        r = finish(admin, "step-8")
        assert r.status_code == 200, r.text
        new = (old[0] + 1, "step-8")
        same_answers_everywhere(admin, new, step_8)
        kill_and_rejoin(admin, 0)  # the copy kept of vLLM's form is replayed too
        answers = load.finish()
    same_answers_everywhere(admin, new, step_8)
    assert check_labels_match_weights(answers, expected) == {"step-1", "step-8"}


def test_only_the_deployment_can_have_a_replica_write_its_weights(deployment, root, tmp_path):
    """The copy route exists only on a deployment's replicas, takes the deployment's key, and writes only under
    the replica's weight roots; the admin address does not forward it."""
    public, admin, _ = deployment
    rows = replicas(admin)
    wanted = root / "not-a-copy"
    for row in rows:
        r = httpx.post(f"{row['url']}/deployment/save_weights", json={"weight_dir": str(wanted)}, timeout=60)
        assert r.status_code == 403 and admin in r.json()["error"]["message"]
    assert (
        httpx.post(f"{admin}/deployment/save_weights", json={"weight_dir": str(wanted)}, timeout=60).status_code == 404
    )
    assert httpx.post(
        f"{public}/deployment/save_weights", json={"weight_dir": str(wanted)}, timeout=60
    ).status_code in (
        403,
        404,
    )
    key = {"x-rlserve-deployment-key": _environ(rows[0]["pid"])["RLSERVE_DEPLOYMENT_KEY"]}
    outside = tmp_path / "outside-the-roots"
    r = httpx.post(f"{rows[0]['url']}/deployment/save_weights", json={"weight_dir": str(outside)}, headers=key)
    assert r.status_code == 403 and "weight_roots" in r.json()["error"]["message"]
    assert not wanted.exists() and not outside.exists()
