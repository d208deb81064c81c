"""The whole RL loop, examples/grpo.py, for a CI-sized number of steps: the reward rises, the
trainer's recomputed logprobs equal rlserve's, and every sample comes from the expected policy."""

from __future__ import annotations

import importlib.util
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.py"


def load_grpo_example():
    """examples/grpo.py as a module (it is a script, not part of the package)."""
    spec = importlib.util.spec_from_file_location("grpo_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grpo():
    return load_grpo_example()


def children() -> set[int]:
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def assert_exact(history) -> None:
    for m in history:
        assert m.mismatch_kl < 1e-6, m
        assert m.max_abs_logprob_diff < 1e-4, m
        assert 0.0 <= m.reward_mean <= 1.0


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists child processes through /proc")
def test_grpo_learns_with_exact_logprobs(grpo, tmp_path):
    before = children()
    # a high learning rate on a task the embedded model starts at ~0.2: it saturates within a few steps
    args = grpo.parse_args(
        ["--steps", "6", "--lr", "3e-4", "--prompts-per-step", "4", "--group-size", "8", "--out", str(tmp_path)]
    )
    history = grpo.train(args)
    assert children() == before  # the server it started is gone

    assert len(history) == 6
    assert_exact(history)
    assert history[0].reward_mean < 0.4
    assert history[-1].reward_mean > history[0].reward_mean + 0.4
    # on-policy: step t samples come from exactly the version after t pushes
    assert [m.policy_version for m in history] == [m.expected_policy_version for m in history] == list(range(6))
    assert all(m.staleness_max == 0 for m in history)

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(6))
    assert {"step", "reward_mean", "mismatch_kl", "max_abs_logprob_diff", "policy_version"} <= rows[0].keys()
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_grpo_async_one_step_off_policy_from_disk(grpo, tmp_path):
    args = grpo.parse_args(
        [
            "--steps",
            "4",
            "--lr",
            "3e-4",
            "--prompts-per-step",
            "2",
            "--group-size",
            "4",
            "--async-steps",
            "1",
            "--update-from-disk",
        ]
    )
    history = grpo.train(args)
    assert_exact(history)  # against the snapshot of the weights that sampled each batch
    # step t trains on samples of the policy one push older (step 0: the initial one)
    assert [m.policy_version for m in history] == [m.expected_policy_version for m in history] == [0, 0, 1, 2]
    assert [m.staleness_max for m in history] == [0, 1, 1, 1]


def test_grpo_hold_back_the_server_admits_rollouts_sent_two_steps_ahead(grpo, tmp_path):
    """Rollouts for step t+2 are sent while step t trains, before the version they may start on exists: the
    server (max_off_policy_steps 1) holds them until that push instead of refusing them or running them two
    versions stale, so every sample is at most one step off-policy."""
    args = grpo.parse_args(
        ["--steps", "4", "--lr", "3e-4", "--prompts-per-step", "2", "--group-size", "4", "--hold-back"]
        + ["--out", str(tmp_path)]
    )
    history = grpo.train(args)
    assert_exact(history)  # against the snapshot of the version that sampled each batch
    assert [m.policy_version for m in history] == [m.expected_policy_version for m in history] == [0, 0, 1, 2]
    assert [m.staleness_max for m in history] == [0, 1, 1, 1]
    # steps 2 and 3 were sent at versions 0 and 1 and ran at 1 and 2: held by the server, 2 groups each
    assert [m.held_requests for m in history] == [0, 0, 2, 2]
    assert [m.staleness_histogram for m in history] == [[8], [0, 8], [0, 8], [0, 8]]
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="lists child processes through /proc")
def test_sigterm_stops_the_server_the_example_started(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--steps", "50", "--prompts-per-step", "2", "--group-size", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        header = proc.stdout.readline()  # printed once its server is up
        assert header.split()[:2] == ["step", "reward"]
        server_pids = {
            int(p) for task in Path(f"/proc/{proc.pid}/task").iterdir() for p in (task / "children").read_text().split()
        }
        assert server_pids
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
        for pid in server_pids:
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
