"""vLLM 0.32's trainer weight push (TRL 1.16's VLLMClient calls, replayed by tests/vllm_trainer.py) against
the default server, whose engine runs in its own process, and under tensor and data parallelism: the
engine process joins, receives, proves and commits; a push that does not match its declaration is
refused naming the tensor while the old weights keep serving; trainers come and go."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import assert_documented_error, start_server, stop_server
from rlserve.model.make import make_model

TRAINER = str(Path(__file__).with_name("vllm_trainer.py"))


def run_trainer(url: str, plan: list) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, TRAINER, url, json.dumps(plan)], capture_output=True, text=True, timeout=600, check=False
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(lines) == len(plan) or plan[-1][2].get("die_after") is not None, proc.stderr[-3000:]
    return lines


def forward_logprobs(ckpt: Path, prompt: list[int], completion: list[int]) -> list[float]:
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([prompt + completion])).logits[0, :-1].float(), dim=-1)
    return [logp[len(prompt) - 1 + i, t].item() for i, t in enumerate(completion)]


def assert_serves(choice: dict, ckpt: Path) -> None:
    ref = forward_logprobs(ckpt, [5, 6, 7, 8], choice["token_ids"])
    got = [e["logprob"] for e in choice["logprobs"]["content"]]
    assert max(abs(a - b) for a, b in zip(got, ref)) < 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("pushed")
    return [make_model("tiny", root / f"seed{s}", seed=s) for s in (5, 6, 7)]


def check_push_cycle(url: str, ckpts: list[Path]) -> None:
    info = httpx.get(f"{url}/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["weight_transfer_config"] is not None
    files = [str(c / "model.safetensors") for c in ckpts]
    out = run_trainer(url, [["join"], ["push", files[0]], ["push", files[1]], ["push", files[2]], ["shutdown"]])
    assert out[0]["status"] == 200 and out[0]["body"] == {"message": "Weight transfer initialized"}
    for step, ckpt in zip(out[1:4], ckpts):
        assert step["status"] == 200 and step["after"] == step["before"] + 1, step
        assert_serves(step["choice"], ckpt)
    assert out[4] == {"step": "shutdown", "status": 200, "body": {"message": "Weight transfer shut down"}}
    # a second trainer joins after the first closed; one killed mid-push leaves the old weights serving
    out = run_trainer(
        url,
        [
            ["join", {"packed_buffer_size_bytes": 1 << 16}],
            ["push", files[0], {"buffer_bytes": 1 << 16, "die_after": 1}],
        ],
    )
    assert out[0]["status"] == 200
    out = run_trainer(url, [["join"], ["push", files[1]], ["shutdown"]])
    assert out[0]["status"] == 200 and out[1]["status"] == 200 and out[1]["after"] == out[1]["before"] + 1
    assert_serves(out[1]["choice"], ckpts[1])


def test_weight_push_on_default_server(ckpts):
    url, proc = start_server()
    try:
        check_push_cycle(url, ckpts)
    finally:
        stop_server(proc)


def test_mismatched_pushes_are_refused_naming_the_tensor(ckpts):
    url, proc = start_server()
    try:
        good, other = str(ckpts[0] / "model.safetensors"), str(ckpts[1] / "model.safetensors")
        plan = [
            ["join"],
            ["push", good],
            ["push", other, {"form": "unknown"}],
            ["push", other, {"form": "shape"}],
            ["push", other, {"form": "checksum"}],
            ["push", other, {"form": "short"}],
            ["join"],
            ["push", other, {"form": "dtype"}],
            ["join"],
            # init_info's buffer size is what the server expects; the trainer packs 1 GiB chunks
            ["join", {"packed_buffer_size_bytes": 4096}],
            ["push", other],
            ["join", {"packed": False}],
            ["push", other],
            ["join"],
            ["push", good],
        ]
        out = run_trainer(url, plan)
        version = out[1]["after"]
        refused = {i: out[i] for i in (2, 3, 4, 5, 7, 10, 12)}
        for i, step in refused.items():
            assert step["status"] == 400, (i, step)
            assert step["after"] == version, (i, step)
        assert "model.layers.0.not_a_weight" in refused[2]["body"]["error"]["message"]
        last = json.loads(json.dumps(out[1]["body"]))  # noqa: F841 - the good push's answer shape
        names = sorted(__import__("safetensors.torch", fromlist=["load_file"]).load_file(other))
        assert names[-1] in refused[3]["body"]["error"]["message"]
        assert names[0] in refused[4]["body"]["error"]["message"] and "sha256" in refused[4]["body"]["error"]["message"]
        assert names[-1] in refused[5]["body"]["error"]["message"]
        assert names[-1] in refused[7]["body"]["error"]["message"]
        for i in (6, 8, 9, 11, 13):
            assert out[i]["status"] == 200, (i, out[i])
        assert out[14]["status"] == 200 and out[14]["after"] == version + 1
        assert_serves(out[14]["choice"], ckpts[0])
    finally:
        stop_server(proc)


@pytest.mark.parametrize("engine", ["core_process", "in_thread"])
def test_an_update_that_lost_a_part_commits_nothing(ckpts, engine):
    """start, one part received and staged, the next refused (it names a tensor the model does not
    have), finish with a new label: the finish is refused and nothing of the update goes live, neither
    the staged part (a mix of two policies) nor the label (a new label on old weights). The next
    update applies. On both engines' paths."""
    url, proc = start_server(*(("--engine.core_process", "false") if engine == "in_thread" else ()))
    try:
        good, other = str(ckpts[0] / "model.safetensors"), str(ckpts[1] / "model.safetensors")
        plan = [
            ["join"],
            ["push", good],
            ["push", other, {"finish": False, "generate": False}],
            ["push", other, {"form": "unknown", "start": False, "finish": False}],
            ["post", "/finish_weight_update", None, {"weight_version": "mixed"}],
            ["push", other],
        ]
        out = run_trainer(url, plan)
        before = out[1]["after"]
        assert out[2]["status"] == 200 and out[3]["status"] == 400, out[2:4]
        assert out[4]["status"] == 409, out[4]
        message = out[4]["body"]["error"]["message"]
        assert "nothing of it was committed" in message and f"policy_version {before}" in message
        assert "model.layers.0.not_a_weight" in message  # the refused part's reason
        assert_documented_error("update-lost-a-part", "/finish_weight_update", 409, "nothing of it was committed")
        assert out[5]["before"] == before and out[5]["status"] == 200 and out[5]["after"] == before + 1, out[5]
        assert httpx.get(f"{url}/weight_info", timeout=30).json()["weight_version"] != "mixed"
        assert_serves(out[5]["choice"], ckpts[1])
    finally:
        stop_server(proc)


def test_an_update_whose_broadcast_broke_commits_nothing(ckpts):
    """start, one part received and staged, then the trainer dies in the next part's broadcast; a
    finish (from whoever sends it) is refused and neither the part nor the label goes live."""
    url, proc = start_server()
    try:
        good, other = str(ckpts[0] / "model.safetensors"), str(ckpts[1] / "model.safetensors")
        out = run_trainer(
            url,
            [
                ["join", {"packed_buffer_size_bytes": 1 << 16}],
                ["push", good, {"buffer_bytes": 1 << 16}],
                ["push", other, {"buffer_bytes": 1 << 16, "finish": False, "generate": False}],
                ["push", other, {"buffer_bytes": 1 << 16, "start": False, "die_after": 1}],
            ],
        )
        before = out[1]["after"]
        assert out[2]["status"] == 200 and len(out) == 3, out
        fin = httpx.post(f"{url}/finish_weight_update", json={"weight_version": "broken"}, timeout=60)
        assert fin.status_code == 409 and "nothing of it was committed" in fin.text, fin.text
        info = httpx.get(f"{url}/weight_info", timeout=30).json()
        assert info["policy_version"] == before and info["weight_version"] != "broken", info
        out = run_trainer(url, [["join"], ["push", other]])
        assert out[1]["status"] == 200 and out[1]["after"] == before + 1, out[1]
        assert_serves(out[1]["choice"], ckpts[1])
    finally:
        stop_server(proc)


@pytest.mark.parametrize("parallel", [("--parallel.tp", "2"), ("--parallel.dp", "2")], ids=["tp2", "dp2"])
def test_weight_push_under_parallelism(ckpts, parallel):
    url, proc = start_server(*parallel, timeout=600)
    try:
        check_push_cycle(url, ckpts)
    finally:
        stop_server(proc)


def test_sigterm_during_pending_rendezvous_exits_clean():
    """The engine process connected to a 'trainer' that never completes the rendezvous: SIGTERM still stops
    the server within 10 s, its engine process with it."""
    url, proc = start_server()
    try:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        children = subprocess.run(
            ["pgrep", "-P", str(proc.pid)], capture_output=True, text=True, check=False
        ).stdout.split()
        init = {"init_info": {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2}}
        pending = threading.Thread(
            target=lambda: httpx.post(f"{url}/init_weight_transfer_engine", json=init, timeout=120), daemon=True
        )
        pending.start()
        conn, _ = listener.accept()  # the engine process is now waiting in the rendezvous
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        for pid in children:
            deadline = time.monotonic() + 10
            while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not Path(f"/proc/{pid}").exists(), f"engine process {pid} left behind"
        conn.close()
        listener.close()
    finally:
        stop_server(proc)
