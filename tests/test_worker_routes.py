"""What vllm-router asks of a worker: /get_load, /get_server_info, /health_generate, the render routes;
and a standalone server keeps taking admin calls (only deployment replicas refuse them)."""

from __future__ import annotations

import httpx

PROMPT = "Hello there"


def test_load_and_server_info(server):
    load = httpx.get(f"{server}/get_load", timeout=30).json()
    assert load["load"] == load["num_running"] + load["num_waiting"] >= 0
    info = httpx.get(f"{server}/get_server_info/", timeout=30).json()
    models = httpx.get(f"{server}/v1/models", timeout=30).json()["data"][0]
    assert info["served_model_name"] == models["id"] and info["max_model_len"] == models["max_model_len"]
    assert isinstance(info["policy_version"], int) and "weight_version" in info


def test_health_generate_runs_one_token(server):
    r = httpx.get(f"{server}/health_generate", timeout=60)
    assert r.status_code == 200 and r.json() == {"status": "healthy"}


def test_render_routes_give_generate_requests(server):
    tokens = httpx.post(f"{server}/tokenize", json={"prompt": PROMPT}, timeout=30).json()["tokens"]
    r = httpx.post(
        f"{server}/v1/completions/render",
        json={"prompt": [PROMPT, [5, 6]], "max_tokens": 3, "temperature": 0, "cache_salt": "7"},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    first, second = r.json()
    assert first["token_ids"] == tokens and second["token_ids"] == [5, 6]
    assert first["sampling_params"] == {"max_tokens": 3, "temperature": 0} and first["cache_salt"] == "7"
    # the rendered request, sent to /inference/v1/generate, gives what /v1/completions gives
    generated = httpx.post(f"{server}/inference/v1/generate", json=first, timeout=60).json()["choices"][0]
    completed = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "return_token_ids": True},
        timeout=60,
    ).json()
    assert generated["token_ids"] == completed["choices"][0]["token_ids"]

    messages = [{"role": "user", "content": PROMPT}]
    (chat,) = httpx.post(f"{server}/v1/chat/completions/render", json={"messages": messages}, timeout=30).json()
    rendered = httpx.post(f"{server}/tokenize", json={"messages": messages}, timeout=30).json()["tokens"]
    assert chat["token_ids"] == rendered
    bad = httpx.post(f"{server}/v1/completions/render", json={"prompt": []}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_standalone_server_takes_admin_calls(server):
    assert httpx.post(f"{server}/resume", timeout=30).status_code == 200
