"""Trainer faults around /init_broadcaster: a second trainer while the first is still in the engine's group gets
a 409 naming the fix; once the first is gone the next one joins. A trainer that dies mid-broadcast fails the push
(the old weights keep serving) and the next trainer is accepted. Only this test's trainers are signalled, by PID."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import pytest

from conftest import start_server, stop_server
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port

TRAINER = textwrap.dedent(
    """
    import json, os, sys
    import httpx
    import torch.distributed as dist
    from safetensors.torch import load_file
    from rlserve import weight_transfer
    from rlserve.client.weights import WeightBroadcaster
    url, port, ckpt, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    tensors = sorted(load_file(ckpt).items())
    b = WeightBroadcaster([url], "127.0.0.1", port, bucket_bytes=1 << 20, timeout_s=60)
    try:
        b.connect()
    except httpx.HTTPStatusError as exc:
        print(json.dumps({"status": exc.response.status_code, "body": exc.response.json()}), flush=True)
        sys.exit(3)
    print("joined", flush=True)
    if mode == "die-mid-push":
        sys.stdin.readline()  # the server's /update_weights is waiting for this push
        buckets = list(weight_transfer._buckets(tensors, 1 << 20))
        assert len(buckets) > 1
        header, flat = [], None
        for bucket in buckets:
            entries, offset = [], 0
            for name, t in bucket:
                n = t.numel() * t.element_size()
                entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset, n])
                offset += n
            header.append(entries)
        weight_transfer._broadcast_header(header, "cpu")
        first = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in buckets[0]])
        dist.broadcast(first, src=0)
        os._exit(1)  # dead after the first of several buckets
    print(json.dumps(b.push(tensors, weight_version=mode)), flush=True)
    if mode == "push-and-stay":
        sys.stdin.readline()
    b.close()
    """
).replace("import json, os, sys", "import json, os, sys\nimport torch")


def trainer(url: str, ckpt, mode: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", TRAINER, url, str(free_port()), str(ckpt), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def finish(proc: subprocess.Popen) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def policy(url: str) -> dict:
    return httpx.get(f"{url}/metrics", params={"format": "json"}, timeout=30).json()


def greedy(url: str) -> list[int]:
    body = {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 0, "max_tokens": 8}}
    return httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module", params=["core-process", "in-thread"])
def server(request):
    extra = () if request.param == "core-process" else ("--engine.core_process", "false")
    url, proc = start_server(*extra)
    try:
        yield url
    finally:
        stop_server(proc)


def test_second_trainer_gets_409_until_the_first_is_gone(server, tmp_path) -> None:
    first_ckpt = make_model("tiny", tmp_path / "a", seed=11) / "model.safetensors"
    second_ckpt = make_model("tiny", tmp_path / "b", seed=12) / "model.safetensors"
    first = trainer(server, first_ckpt, "push-and-stay")
    try:
        assert first.stdout.readline().strip() == "joined"
        pushed = json.loads(first.stdout.readline())
        assert policy(server)["weight_version"] == "push-and-stay"
        code, out = finish(trainer(server, second_ckpt, "push"))  # the first is alive and in the group
        assert code == 3, out
        refused = json.loads(out.splitlines()[-1])
        assert refused["status"] == 409
        assert "still running" in refused["body"]["error"]["message"]
        assert "stop that trainer" in refused["body"]["error"]["message"]
    finally:
        first.send_signal(signal.SIGKILL)  # the first trainer goes away without leaving the group
        first.wait()
    code, out = finish(trainer(server, second_ckpt, "push"))
    assert code == 0, out
    assert json.loads(out.splitlines()[-1]) == [pushed[0] + 1]
    assert policy(server)["weight_version"] == "push"


def test_trainer_dying_mid_broadcast_keeps_the_old_weights_and_the_next_trainer_is_accepted(server, tmp_path):
    ckpt = make_model("tiny", tmp_path / "c", seed=13) / "model.safetensors"
    before, tokens = policy(server), greedy(server)
    dying = trainer(server, ckpt, "die-mid-push")
    try:
        assert dying.stdout.readline().strip() == "joined"
        result: dict = {}
        update = threading.Thread(
            target=lambda: result.update(
                r=httpx.post(
                    f"{server}/update_weights", json={"weight_dir": None, "weight_version": "never"}, timeout=300
                )
            )
        )
        update.start()
        dying.stdin.write("go\n")
        dying.stdin.flush()
        update.join(timeout=300)
        assert not update.is_alive()
        r = result["r"]
        assert r.status_code == 409, r.text
        assert "cut off" in r.json()["error"]["message"] and "previous weights keep serving" in r.text
        assert dying.wait(timeout=60) == 1
    finally:
        if dying.poll() is None:
            dying.kill()
            dying.wait()
    after = policy(server)
    assert (after["current_policy_version"], after["weight_version"]) == (
        before["current_policy_version"],
        before["weight_version"],
    )
    assert greedy(server) == tokens
    code, out = finish(trainer(server, ckpt, "push"))
    assert code == 0, out
    assert json.loads(out.splitlines()[-1]) == [before["current_policy_version"] + 1]
