"""A trainer speaking vLLM 0.32's weight-transfer protocol as TRL 1.16's VLLMClient does (its HTTP calls,
vLLM's packed producer over a gloo group, since NCCL needs CUDA), driven by a JSON plan; one JSON line
per step on stdout. Run as `python vllm_trainer.py BASE_URL PLAN_JSON`."""

from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import requests
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from rlserve.runtime.ports import free_port
from rlserve.weight_transfer import init_group

base, plan = sys.argv[1], json.loads(sys.argv[2])
session = requests.Session()


def post(path: str, body: dict) -> tuple[int, dict]:
    r = session.post(base + path, json=body, timeout=600)
    return r.status_code, r.json()


def version() -> int:
    return session.get(base + "/weight_info").json()["policy_version"]


def broadcast(flats: list[torch.Tensor], buffer_bytes: int, packed: bool, die_after: int | None = None) -> None:
    """vLLM's packed producer: a chunk closes once its size exceeds buffer_bytes; unpacked: one per tensor."""
    chunks, chunk, size = [], [], 0
    for t in flats:
        chunk.append(t)
        size += t.numel()
        if not packed or size > buffer_bytes:
            chunks.append(torch.cat(chunk))
            chunk, size = [], 0
    if chunk:
        chunks.append(torch.cat(chunk))
    for sent, c in enumerate(chunks):
        if die_after is not None and sent == die_after:
            os._exit(3)  # a trainer killed mid-push
        dist.broadcast(c, src=0)


def join(extra: dict) -> dict:
    world = session.get(base + "/get_world_size").json()["world_size"] + 1
    port = free_port()
    info = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": world,
        "packed": True,
        **extra,
    }
    if dist.is_initialized():
        dist.destroy_process_group()
    for _ in range(20):  # a server still unwinding a dead trainer's push answers 409 for a moment
        with ThreadPoolExecutor(1) as pool:
            joined = pool.submit(post, "/init_weight_transfer_engine", {"init_info": info})
            try:
                init_group("127.0.0.1", port, 0, world, 15, backend="gloo")
            except RuntimeError:
                pass
            status, body = joined.result()
        if status != 409:
            return {"status": status, "body": body}
        if dist.is_initialized():
            dist.destroy_process_group()
        info["master_port"] = port = free_port()
    return {"status": status, "body": body}


def push(
    ckpt: str,
    form: str,
    info_extra: dict,
    buffer_bytes: int,
    packed: bool,
    die_after: int | None,
    body_extra: dict,
    generate: bool,
    start: bool = True,
    finish: bool = True,
) -> dict:
    tensors = sorted(load_file(ckpt).items())
    names = [n for n, _ in tensors]
    dtypes = [str(t.dtype).removeprefix("torch.") for _, t in tensors]
    shapes = [list(t.shape) for _, t in tensors]
    flats = [t.contiguous().view(-1).view(torch.uint8) for _, t in tensors]
    if form == "unknown":
        names[0] = "model.layers.0.not_a_weight"
    elif form == "shape":
        shapes[-1] = [shapes[-1][0] * 2, *shapes[-1][1:]]
        flats[-1] = torch.cat([flats[-1], flats[-1]])
    elif form == "short":
        flats[-1] = flats[-1][:-8]
    elif form == "dtype":  # declared bfloat16, the float32 bytes sent
        dtypes[-1] = "bfloat16"
    elif form == "checksum":
        info_extra = {**info_extra, "checksums": {names[0]: "0" * 64}}
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes, **info_extra}
    before = version()
    if start:
        post("/start_weight_update", {})
    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(post, "/update_weights", {"update_info": info, **body_extra})
        try:
            broadcast(flats, buffer_bytes, packed, die_after)
        except RuntimeError as exc:  # the server dropped the group after refusing the push
            print(json.dumps({"trainer_error": str(exc)[:200]}), file=sys.stderr)
        status, body = done.result()
    fin = post("/finish_weight_update", {}) if status == 200 and finish else None
    out = {"status": status, "body": body, "before": before, "after": version(), "finish": fin}
    if status == 200 and generate:  # a generation under the new weights
        gen = {
            "token_ids": [5, 6, 7, 8],
            "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0},
        }
        out["choice"] = session.post(base + "/inference/v1/generate", json=gen, timeout=120).json()["choices"][0]
    return out


for step in plan:
    kind = step[0]
    if kind == "join":
        result = join(step[1] if len(step) > 1 else {})
    elif kind == "push":
        opts = step[2] if len(step) > 2 else {}
        result = push(
            step[1],
            opts.get("form", "ok"),
            opts.get("info", {}),
            opts.get("buffer_bytes", 1 << 30),
            opts.get("packed", True),
            opts.get("die_after"),
            opts.get("body", {}),  # fields beside update_info
            opts.get("generate", True),  # false: the engine may be asleep or paused
            opts.get("start", True),  # false: a further part of the update already open
            opts.get("finish", True),  # false: more parts follow (or a "post" step finishes it)
        )
    elif kind == "post":  # another call between pushes (/sleep, /wake_up): ["post", path, query, json body]
        query, body = (step[2:] + [None, None])[:2]
        r = session.post(base + step[1], params=query, json=body, timeout=60)
        result = {"status": r.status_code, "body": r.json()}
    elif kind == "shutdown":
        status, body = post("/shutdown_weight_transfer_engine", {})
        if dist.is_initialized():
            dist.destroy_process_group()
        result = {"status": status, "body": body}
    else:
        raise SystemExit(f"unknown step {kind!r}")
    print(json.dumps({"step": kind, **result}), flush=True)
