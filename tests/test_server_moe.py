"""A real server with a Qwen3-MoE model: routed_experts exactly as docs/protocols.md §2.14 on the
generate routes (never on chat, never in streams), and a detector ending rollouts over HTTP."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server
from rlserve.model.make import make_model
from test_moe import hf_experts

WINDOW = 6  # every token is "confident" under a threshold of 1e-9: completions end after WINDOW + EOS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_model("tiny-moe", tmp_path_factory.mktemp("models") / "tiny-moe")


@pytest.fixture(scope="module")
def moe_server(model_dir):
    url, proc = start_server(
        "--model.name",
        str(model_dir),
        "--enable_return_routed_experts",
        "--logits_processors.repetition_detection.window",
        str(WINDOW),
        "--logits_processors.repetition_detection.prob_threshold",
        "1e-9",
    )
    try:
        yield url
    finally:
        stop_server(proc)


def decode(payload: dict) -> np.ndarray:
    assert set(payload) == {"data", "shape", "start", "dtype"}
    return np.frombuffer(
        base64.b64decode(payload["data"]), dtype="<" + {"uint8": "u1", "uint16": "u2"}[payload["dtype"]]
    ).reshape(payload["shape"])


PROMPT = [5, 17, 300, 2, 99, 1000, 42, 7, 8, 9, 10, 11]


def test_inference_generate_returns_every_forwarded_row(moe_server, model_dir):
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 1.0, "max_tokens": 20, "n": 2, "seed": 1}}
    r = httpx.post(f"{moe_server}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for choice in r.json()["choices"]:
        tokens = choice["token_ids"]
        assert len(tokens) == WINDOW + 1 and (choice["finish_reason"], choice["stop_reason"]) == (
            "stop",
            "repetition_detection",
        )
        re = choice["routed_experts"]
        assert re["start"] == 0 and re["dtype"] == "uint8"
        assert re["shape"] == [len(PROMPT) + len(tokens) - 1, 3, 2]
        np.testing.assert_array_equal(decode(re), hf_experts(hf, (PROMPT + tokens)[:-1]))


def test_prompt_start_skips_rows_already_known(moe_server):
    body = {"token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 20}}
    full = httpx.post(f"{moe_server}/inference/v1/generate", json=body, timeout=120).json()["choices"][0][
        "routed_experts"
    ]
    body["sampling_params"]["routed_experts_prompt_start"] = 10
    part = httpx.post(f"{moe_server}/inference/v1/generate", json=body, timeout=120).json()["choices"][0][
        "routed_experts"
    ]
    assert part["start"] == 10 and part["shape"][0] == full["shape"][0] - 10
    np.testing.assert_array_equal(decode(part), decode(full)[10:])
    body["sampling_params"]["routed_experts_prompt_start"] = -1
    r = httpx.post(f"{moe_server}/inference/v1/generate", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "routed_experts_prompt_start"


def test_sglang_generate_returns_routed_experts_when_asked(moe_server):
    body = {
        "input_ids": PROMPT,
        "sampling_params": {"temperature": 0, "max_new_tokens": 20},
        "return_routed_experts": True,
    }
    meta = httpx.post(f"{moe_server}/generate", json=body, timeout=120).json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": "repetition_detection"}
    assert decode(meta["routed_experts"]).shape == (len(PROMPT) + meta["completion_tokens"] - 1, 3, 2)
    del body["return_routed_experts"]
    assert "routed_experts" not in httpx.post(f"{moe_server}/generate", json=body, timeout=120).json()["meta_info"]


def test_never_on_chat_nor_in_streams(moe_server):
    chat = httpx.post(
        f"{moe_server}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=120,
    )
    assert chat.status_code == 200  # vLLM's always-present key, null: chat never replays
    assert all(c["routed_experts"] is None for c in chat.json()["choices"])
    body = {"token_ids": PROMPT, "stream": True, "sampling_params": {"temperature": 0, "max_tokens": 4}}
    with httpx.stream("POST", f"{moe_server}/inference/v1/generate", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line.startswith("data: {")]
    assert lines and all(json.loads(line[6:])["choices"][0].get("routed_experts") is None for line in lines)


def test_sglang_asks_a_server_without_replay(server):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True}
    r = httpx.post(f"{server}/generate", json=body, timeout=120)
    assert r.status_code == 400 and "enable_return_routed_experts" in r.json()["error"]["message"]
    choice = httpx.post(
        f"{server}/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, timeout=120
    ).json()["choices"][0]
    assert choice["routed_experts"] is None
