"""The RL control plane under abuse: per-span version labels, abandoned updates, every weight and
adapter file read under a root (symlinks, index shards, FIFOs, broken links), bad adapters,
/upload_adapter."""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_documented_error, server_log, start_server, stop_server, wait_queued
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port

PROMPT = [11, 22, 33, 44, 55]


@pytest.fixture(scope="module")
def outside(tmp_path_factory):
    return tmp_path_factory.mktemp("outside")


@pytest.fixture(scope="module")
def srv(root):
    url, proc = start_server("--weight_roots", json.dumps([str(root)]), "--server.max_upload_bytes", str(1 << 20))
    try:
        yield url, proc
    finally:
        stop_server(proc)


def versions(url):
    return httpx.get(f"{url}/get_weight_version", timeout=120).json()


def generated_tokens(url) -> float:
    text = httpx.get(f"{url}/metrics", timeout=120).text
    return float(re.search(r"^vllm:generation_tokens_total(?:{[^}]*})? (\S+)$", text, re.M).group(1))


def step_once(url, n: int) -> None:
    """One engine step of a paused server: each of the n requests in flight makes exactly one token (the first
    step prefills every short prompt and samples its first token), and the engine is frozen again."""
    start = generated_tokens(url)
    r = httpx.post(f"{url}/resume", params={"steps": 1}, timeout=120)
    assert r.status_code == 200 and r.json() == {"status": "paused", "steps": 1}, r.text
    assert generated_tokens(url) == start + n


def test_each_span_keeps_the_label_its_tokens_were_produced_under(srv, root):
    url, _ = srv
    assert httpx.post(f"{url}/update_weight_version", json={"new_version": "step-1"}, timeout=120).status_code == 200
    v0 = versions(url)["policy_version"]
    sampling = {"temperature": 0, "max_tokens": 400, "ignore_eos": True}
    calls = [
        ("/v1/completions", {"prompt": PROMPT, **sampling}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **sampling}),
        ("/inference/v1/generate", {"token_ids": PROMPT, "sampling_params": sampling}),
        (
            "/generate",
            {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}},
        ),
    ]
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=120).status_code == 200

    async def scenario():
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            tasks = [asyncio.create_task(client.post(path, json=body)) for path, body in calls]
            await asyncio.to_thread(wait_queued, url, len(calls))
            # every request makes tokens under step-1, then under a new policy (step-2), then relabelled (step-3)
            await asyncio.to_thread(step_once, url, len(calls))
            r = await client.post(
                "/update_weights",
                json={"weight_dir": str(make_model("tiny", root / "s2", seed=2)), "weight_version": "step-2"},
            )
            assert r.status_code == 200, r.text
            await asyncio.to_thread(step_once, url, len(calls))
            assert (await client.post("/update_weight_version", json={"new_version": "step-3"})).status_code == 200
            await asyncio.to_thread(step_once, url, len(calls))
            assert (await client.post("/abort_requests", json={})).json()["aborted"] == len(calls)
            return [(await t) for t in tasks]

    try:
        responses = asyncio.run(scenario())
    finally:  # a failed check must not leave the module's server paused for the next test
        httpx.post(f"{url}/resume", timeout=120)
    for (path, _), r in zip(calls, responses):
        assert r.status_code == 200, r.text
        body = r.json()
        choice = body["meta_info"] if path == "/generate" else body["choices"][0]
        spans = choice["weight_versions"]
        assert [(s["version"], s["policy_version"]) for s in spans] == [
            ("step-1", v0),
            ("step-2", v0 + 1),
            ("step-3", v0 + 1),
        ], path
        assert spans[0]["start"] == 0 and all(a["end"] == b["start"] for a, b in zip(spans, spans[1:]))
        assert all(s["end"] > s["start"] for s in spans)
        assert choice["weight_version"] == "step-3" and choice["policy_version"] == v0 + 1


def test_same_directory_with_a_new_label_is_applied(srv, root):
    url, _ = srv
    target = make_model("tiny", root / "relabel", seed=3)
    first = httpx.post(f"{url}/update_weights", json={"weight_dir": str(target), "weight_version": "a"}, timeout=60)
    again = httpx.post(f"{url}/update_weights", json={"weight_dir": str(target), "weight_version": "a"}, timeout=60)
    assert first.json()["policy_version"] == again.json()["policy_version"]  # a retry: no-op
    new = httpx.post(f"{url}/update_weights", json={"weight_dir": str(target), "weight_version": "b"}, timeout=60)
    assert new.json()["policy_version"] == first.json()["policy_version"] + 1
    assert versions(url)["weight_version"] == "b"


def _adapter_copy(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


ADAPTER_ROUTES = [
    ("/v1/load_lora_adapter", lambda p: {"lora_name": "x", "lora_path": str(p)}),
    ("/load_lora_adapter", lambda p: {"lora_name": "x", "lora_path": str(p)}),
    ("/load_adapter", lambda p: {"adapter_path": str(p)}),
]
WEIGHT_ROUTES = [
    ("/update_weights", lambda p: {"weight_dir": str(p)}),
    ("/update_weights", lambda p: {"weight_path": str(p)}),
    ("/update_weights_from_disk", lambda p: {"model_path": str(p)}),
]


def test_every_file_read_resolves_under_a_root(srv, root, outside, peft_adapter):
    url, _ = srv
    before = versions(url)["policy_version"]
    # an adapter dir inside the root whose weights file links outside it
    real = _adapter_copy(peft_adapter[0], outside / "adapter")
    escape = root / "adapter-escape"
    escape.mkdir()
    (escape / "adapter_config.json").write_bytes((real / "adapter_config.json").read_bytes())
    (escape / "adapter_model.safetensors").symlink_to(real / "adapter_model.safetensors")
    for path, body in ADAPTER_ROUTES:
        r = httpx.post(f"{url}{path}", json=body(escape), timeout=120)
        assert r.status_code == 403 and "weight roots" in r.json()["error"]["message"], (path, r.text)
    # a weight dir whose model.safetensors links outside
    ckpt = make_model("tiny", outside / "ckpt", seed=4)
    linked = root / "linked-weights"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    # index files naming shards outside the directory
    dotdot, absolute = root / "index-dotdot", root / "index-absolute"
    for d, shard in (
        (dotdot, f"../../{outside.name}/ckpt/model.safetensors"),
        (absolute, str(ckpt / "model.safetensors")),
    ):
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"model.norm.weight": shard}}))
    for path, body in WEIGHT_ROUTES:
        r = httpx.post(f"{url}{path}", json=body(linked), timeout=60)
        assert r.status_code == 403 and "weight roots" in r.json()["error"]["message"], (path, r.text)
        for d in (dotdot, absolute):
            r = httpx.post(f"{url}{path}", json=body(d), timeout=60)
            assert r.status_code == 400 and "shards must be files inside" in r.json()["error"]["message"], (
                path,
                r.text,
            )
    assert versions(url)["policy_version"] == before


def test_broken_links_and_fifos_are_refused_and_updates_keep_working(srv, root):
    url, _ = srv
    before = versions(url)["policy_version"]
    broken = root / "broken"
    broken.mkdir()
    (broken / "model.safetensors").symlink_to(root / "nowhere.safetensors")
    fifo = root / "fifo"
    fifo.mkdir()
    os.mkfifo(fifo / "model.safetensors")
    fifo_adapter = root / "fifo-adapter"
    fifo_adapter.mkdir()
    (fifo_adapter / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8}))
    os.mkfifo(fifo_adapter / "adapter_model.safetensors")
    for path, body in WEIGHT_ROUTES:
        r = httpx.post(f"{url}{path}", json=body(broken), timeout=60)
        assert r.status_code == 400 and "broken symlink" in r.json()["error"]["message"], (path, r.text)
        r = httpx.post(f"{url}{path}", json=body(fifo), timeout=60)
        assert r.status_code == 400 and "not a regular file" in r.json()["error"]["message"], (path, r.text)
    for path, body in ADAPTER_ROUTES:
        r = httpx.post(f"{url}{path}", json=body(fifo_adapter), timeout=60)
        assert r.status_code == 400 and "not a regular file" in r.json()["error"]["message"], (path, r.text)
    assert versions(url)["policy_version"] == before
    # an unrelated broken link beside a good checkpoint is not read; the control plane is not wedged
    good = make_model("tiny", root / "good", seed=5)
    (good / "notes.txt").symlink_to(root / "gone.txt")
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(good)}, timeout=60)
    assert r.status_code == 200 and r.json()["policy_version"] == before + 1


def test_nan_and_rank_zero_adapters_are_refused(srv, root, peft_adapter):
    url, _ = srv
    before = versions(url)["policy_version"]
    nan = _adapter_copy(peft_adapter[0], root / "adapter-nan")
    tensors = load_file(nan / "adapter_model.safetensors")
    name = sorted(tensors)[0]
    tensors[name][0, 0] = math.nan
    save_file(tensors, nan / "adapter_model.safetensors")
    zero = _adapter_copy(peft_adapter[0], root / "adapter-r0")
    cfg = json.loads((zero / "adapter_config.json").read_text())
    (zero / "adapter_config.json").write_text(json.dumps({**cfg, "r": 0}))
    for path, body in ADAPTER_ROUTES:
        r = httpx.post(f"{url}{path}", json=body(nan), timeout=120)
        assert r.status_code == 400 and "NaN" in r.json()["error"]["message"], (path, r.text)
        r = httpx.post(f"{url}{path}", json=body(zero), timeout=120)
        assert r.status_code == 400 and "r must be a positive integer" in r.json()["error"]["message"], (path, r.text)
    assert versions(url)["policy_version"] == before


def _lps(url, prompt):
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0, "return_token_ids": True}
    choice = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"]


def _peft_lps(peft, prompt, ids):
    with torch.no_grad():
        logits = peft(torch.tensor([prompt + ids])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    return lp


def test_upload_adapter_peft_and_mlx_layouts(srv, root, peft_adapter, tmp_path):
    url, _ = srv
    path, peft = peft_adapter
    r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(root / "lora-base")}, timeout=60)
    assert r.status_code == 200  # the adapter was trained on this base
    weights, config = (path / "adapter_model.safetensors").read_bytes(), (path / "adapter_config.json").read_bytes()
    files = {"adapter_weights": ("../../evil.safetensors", weights), "adapter_config": ("/etc/evil.json", config)}
    r = httpx.post(f"{url}/upload_adapter", files=files, timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "success", r.text
    ids, lps = _lps(url, PROMPT)  # every base-model request now runs under the uploaded adapter
    assert torch.allclose(torch.tensor(lps), _peft_lps(peft, PROMPT, ids), atol=1e-4)
    assert not [f for d in (root.parent, root, tmp_path) for f in d.iterdir() if f.name.startswith("evil")]
    # the same adapter in MLX layout: lora_a [in, r], lora_b [r, out], delta = scale * x A B
    cfg = json.loads(config)
    mlx = {}
    for key, t in load_file(path / "adapter_model.safetensors").items():
        m = re.match(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight", key)
        mlx[f"model.layers.{m[1]}.{m[2]}.{m[3]}.lora_{m[4].lower()}"] = t.t().contiguous()
    mlx_file = tmp_path / "adapters.safetensors"
    save_file(mlx, mlx_file)
    mlx_cfg = {"lora_parameters": {"rank": cfg["r"], "scale": cfg["lora_alpha"] / cfg["r"], "dropout": 0.0}}
    r = httpx.post(
        f"{url}/upload_adapter",
        timeout=60,
        files={
            "adapter_weights": ("adapters.safetensors", mlx_file.read_bytes()),
            "adapter_config": ("adapter_config.json", json.dumps(mlx_cfg).encode()),
        },
    )
    assert r.status_code == 200, r.text
    assert _lps(url, PROMPT) == (ids, lps)
    # refused: pickles, configs that are not JSON, bodies over server.max_upload_bytes
    pickled = b"\x80\x04\x95" + b"cos\nsystem\n" * 10
    r = httpx.post(
        f"{url}/upload_adapter", files={"adapter_weights": ("a", pickled), "adapter_config": ("c", config)}, timeout=120
    )
    assert r.status_code == 400 and "cannot read" in r.json()["error"]["message"]
    r = httpx.post(
        f"{url}/upload_adapter", files={"adapter_weights": ("a", weights), "adapter_config": ("c", b"{")}, timeout=120
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "adapter_weights"
    big = b"\0" * (2 << 20)
    r = httpx.post(
        f"{url}/upload_adapter", files={"adapter_weights": ("a", big), "adapter_config": ("c", config)}, timeout=120
    )
    assert r.status_code == 413 and "max_upload_bytes" in r.json()["error"]["message"]
    r = httpx.post(f"{url}/upload_adapter", data={"adapter_weights": "x"}, timeout=120)
    assert r.status_code == 400 and "multipart files" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=120).status_code == 200


TRAINER = textwrap.dedent(
    """
    import sys
    import torch.distributed as dist
    from safetensors.torch import load_file
    from rlserve import weight_transfer
    port, ckpt, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    weight_transfer.init_group("127.0.0.1", port, 0, world, 120)
    print("joined", flush=True)
    sys.stdin.readline()  # hold the server's update (it waits for this push) until told
    weight_transfer.send(sorted(load_file(ckpt).items()), 1 << 20)
    print("sent", flush=True)
    dist.destroy_process_group()
    """
)


def test_an_update_whose_caller_left_before_it_started_is_never_applied(srv, root):
    _abandoned_update(*srv, root, engines=1)


def test_an_abandoned_update_is_never_applied_with_data_parallel_engines(root):
    """The same rule when one API server fans updates out to two engine processes."""
    url, proc = start_server("--weight_roots", json.dumps([str(root)]), "--parallel.dp", "2")
    try:
        _abandoned_update(url, proc, root, engines=2)
    finally:
        stop_server(proc)


def _abandoned_update(url: str, proc: subprocess.Popen, root: Path, engines: int) -> None:
    pushed = make_model("tiny", root / f"pushed-{engines}", seed=6)
    waiting = make_model("tiny", root / f"abandoned-{engines}", seed=7)
    port = free_port()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(port), str(pushed / "model.safetensors"), str(1 + engines)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        r = httpx.post(
            f"{url}/init_broadcaster",
            json={"host": "127.0.0.1", "port": port, "rank_offset": 0, "inference_world_size": engines, "timeout": 120},
            timeout=120,
        )
        assert r.status_code == 200
        assert trainer.stdout.readline().strip() == "joined"
        v0 = versions(url)["policy_version"]
        held = {}
        push = threading.Thread(
            target=lambda: held.update(
                r=httpx.post(
                    f"{url}/update_weights", json={"weight_dir": None, "weight_version": "pushed"}, timeout=120
                )
            )
        )
        push.start()
        deadline = time.monotonic() + 60
        while not versions(url)["updating"]:  # the push holds the update lock until the trainer sends
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(httpx.TimeoutException):  # queued behind the push; the caller gives up
            httpx.post(f"{url}/update_weights", json={"weight_dir": str(waiting), "weight_version": "late"}, timeout=1)
        while "weight update dropped" not in server_log(proc):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        trainer.stdin.write("go\n")
        trainer.stdin.flush()
        push.join(timeout=120)
        assert held["r"].status_code == 200 and held["r"].json()["policy_version"] == v0 + 1
        assert trainer.wait(timeout=60) == 0
        state = versions(url)
        assert state == {"weight_version": "pushed", "policy_version": v0 + 1, "updating": False}
        r = httpx.post(f"{url}/update_weights", json={"weight_dir": str(waiting)}, timeout=60)
        assert r.json()["policy_version"] == v0 + 2  # the control plane is not wedged
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()


# the rows of docs/errors.md's control-plane table, each asserted by a test above or in test_server_process.py
DOCUMENTED = [
    ("weight-file-outside-root", "/update_weights", 403, "weight roots"),
    ("adapter-file-outside-root", "/v1/load_lora_adapter", 403, "weight roots"),
    ("index-shard-escape", "/update_weights", 400, "shards must be files inside"),
    ("weight-broken-symlink", "/update_weights", 400, "broken symlink"),
    ("weight-fifo", "/update_weights", 400, "not a regular file"),
    ("adapter-fifo", "/v1/load_lora_adapter", 400, "not a regular file"),
    ("adapter-nan", "/v1/load_lora_adapter", 400, "NaN"),
    ("adapter-rank-zero", "/v1/load_lora_adapter", 400, "r must be a positive integer"),
    ("upload-too-big", "/upload_adapter", 413, "max_upload_bytes"),
    ("upload-not-safetensors", "/upload_adapter", 400, "cannot read"),
    ("upload-not-multipart", "/upload_adapter", 400, "multipart files"),
    ("shutting-down", "/v1/completions", 503, "shutting down"),
]


@pytest.mark.parametrize("row", DOCUMENTED, ids=[r[0] for r in DOCUMENTED])
def test_control_plane_error_is_documented(row):
    assert_documented_error(*row)
