"""The RL layer over HTTP: token-in/token-out, policy versions, hot weight updates, pause modes,
trainer push over torch.distributed, LoRA adapters, admin keys."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server, wait_queued
from rlserve.model.make import make_model
from rlserve.runtime.ports import free_port
from test_engine import hf_logprobs

PROMPTS = [[11, 22, 33, 44, 55], [100, 7, 300, 9], [5]]


@pytest.fixture(scope="module")
def next_weights(root):
    return make_model("tiny", root / "step-1", seed=1)


@pytest.fixture(scope="module")
def rl_server(root):
    url, proc = start_server("--weight_roots", json.dumps([str(root)]), "--server.admin_api_key", "admin")
    try:
        yield url
    finally:
        stop_server(proc)


ADMIN = {"Authorization": "Bearer admin"}


def generate(url, token_ids, **sampling):
    body = {"token_ids": token_ids, "sampling_params": {"temperature": 0, "max_tokens": 8, "logprobs": 0, **sampling}}
    r = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def choice_lps(choice):
    return [e["logprob"] for e in choice["logprobs"]["content"]]


# hf_check's references, by the model's files, the prompt and the token count: transformers' greedy ids and the
# logprobs of its forward over them
_HF_REFERENCES: dict[tuple, tuple[list[int], torch.Tensor]] = {}


def _files_of(model_dir) -> tuple:
    """What a model directory holds, by path, size and mtime: a key that changes when any of its files does."""
    d = Path(model_dir).resolve()
    return (str(d), *sorted((f.name, st.st_size, st.st_mtime_ns) for f in d.iterdir() for st in [f.stat()]))


def hf_check(model_dir, prompt, choice):
    """The choice's tokens are transformers' greedy ones and its logprobs those of transformers' forward (1e-4).
    Each reference is computed once per model files and prompt: tests that ask every replica the same prompt
    compare each answer with the same deterministic computation on the same weights."""
    ids = choice["token_ids"]
    key = (_files_of(model_dir), tuple(prompt), len(ids))
    if key not in _HF_REFERENCES:
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        ref = hf.generate(
            torch.tensor([prompt]), max_new_tokens=len(ids), do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(prompt) :].tolist()
        _HF_REFERENCES[key] = ref, hf_logprobs(hf, prompt, ref).gather(1, torch.tensor(ref).unsqueeze(1)).squeeze(1)
    ref, lp = _HF_REFERENCES[key]
    assert ids == ref
    assert torch.allclose(torch.tensor(choice_lps(choice)), lp, atol=1e-4)


def test_token_in_token_out_shape(rl_server):
    out = generate(rl_server, PROMPTS[0], max_tokens=None)
    choice = out["choices"][0]
    # max_tokens absent: generate to the end of the context (512)
    assert len(choice["token_ids"]) == 512 - len(PROMPTS[0]) or choice["finish_reason"] == "stop"
    assert len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    assert choice["policy_version"] == 0 and choice["weight_versions"][0]["policy_version"] == 0
    assert out["usage"]["prompt_tokens"] == len(PROMPTS[0])


def test_update_weights_from_dir(rl_server, next_weights, root):
    before = [generate(rl_server, p)["choices"][0] for p in PROMPTS]
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(next_weights)}, timeout=60)
    assert r.status_code == 401  # admin routes need the admin key
    version = httpx.get(f"{rl_server}/metrics", params={"format": "json"}).json()["current_policy_version"]
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(next_weights)}, headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["policy_version"] == version + 1
    # a retried update of the same unchanged directory is a no-op
    r = httpx.post(f"{rl_server}/update_weights/", json={"weight_dir": str(next_weights)}, headers=ADMIN, timeout=60)
    assert r.status_code == 200 and r.json()["policy_version"] == version + 1
    for prompt, _old in zip(PROMPTS, before):
        new = generate(rl_server, prompt)["choices"][0]
        assert new["policy_version"] == version + 1
        hf_check(next_weights, prompt, new)
    assert [generate(rl_server, p)["choices"][0]["token_ids"] for p in PROMPTS] != [c["token_ids"] for c in before]


def test_bad_checkpoints_are_refused_and_old_weights_keep_serving(rl_server, root, tmp_path_factory):
    before = generate(rl_server, PROMPTS[1])["choices"][0]
    version = before["policy_version"]
    bad = make_model("tiny", root / "bad", seed=2)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 3])
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(bad)}, headers=ADMIN, timeout=60)
    assert r.status_code == 400 and "previous weights keep serving" in r.json()["error"]["message"]
    from safetensors.torch import load_file, save_file

    wrong = make_model("tiny", root / "wrong-shape", seed=2)
    tensors = load_file(wrong / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"][:-1].clone()
    save_file(tensors, wrong / "model.safetensors")
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(wrong)}, headers=ADMIN, timeout=60)
    assert r.status_code == 400 and "model.norm.weight has shape" in r.json()["error"]["message"]
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(root / "missing")}, headers=ADMIN)
    assert r.status_code == 404
    outside = tmp_path_factory.mktemp("outside")
    r = httpx.post(f"{rl_server}/update_weights", json={"weight_dir": str(outside)}, headers=ADMIN)
    assert r.status_code == 403 and "weight roots" in r.json()["error"]["message"]
    after = generate(rl_server, PROMPTS[1])["choices"][0]
    assert after["token_ids"] == before["token_ids"] and choice_lps(after) == choice_lps(before)
    assert after["policy_version"] == version


def test_policy_version_window_gives_409(rl_server):
    current = httpx.get(f"{rl_server}/metrics", params={"format": "json"}).json()["current_policy_version"]
    body = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 1}, "min_policy_version": current + 1}
    r = httpx.post(f"{rl_server}/inference/v1/generate", json=body)
    assert r.status_code == 409 and "older" in r.json()["error"]["message"]
    r = httpx.post(
        f"{rl_server}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "max_policy_version": current - 1}
    )
    assert (r.status_code == 409) == (current >= 1)
    r = httpx.post(
        f"{rl_server}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1, "min_policy_version": current}
    )
    assert r.status_code == 200 and r.json()["choices"][0]["policy_version"] == current


LONG = 500  # new tokens: with the 5-token prompt, within the test server's 512-token context


@pytest.mark.parametrize("mode", ["keep", "abort", "wait"])
def test_pause_modes_with_an_update_in_between(rl_server, root, mode):
    async def scenario():
        async with httpx.AsyncClient(base_url=rl_server, timeout=120) as client:
            body = {
                "token_ids": PROMPTS[0],
                "sampling_params": {"temperature": 0, "max_tokens": LONG, "ignore_eos": True, "logprobs": 0},
            }
            # all three mid-decode by construction: queued behind a pause, then two engine steps (each is
            # admitted, prefilled and one token further) after which the engine is frozen again
            assert (await client.post("/pause", params={"mode": "keep"}, headers=ADMIN)).status_code == 200
            tasks = [asyncio.create_task(client.post("/inference/v1/generate", json=body)) for _ in range(3)]
            await asyncio.to_thread(wait_queued, rl_server, 3)
            r = await client.post("/resume", params={"steps": 2}, headers=ADMIN)
            assert r.json() == {"status": "paused", "steps": 2}
            r = await client.post("/pause", params={"mode": mode}, headers=ADMIN)
            assert r.status_code == 200 and r.json()["status"] == "paused"
            assert (await client.get("/is_paused")).json() == {"is_paused": True}
            target = make_model("tiny", root / f"pause-{mode}", seed=3)
            r = await client.post("/update_weights", json={"weight_dir": str(target)}, headers=ADMIN)
            assert r.status_code == 200
            assert (await client.get("/health")).status_code == 200
            assert (await client.post("/resume", headers=ADMIN)).json() == {"status": "resumed"}
            return r.json()["policy_version"], [(await t).json()["choices"][0] for t in tasks]

    version, choices = asyncio.run(scenario())
    for c in choices:
        versions = [s["policy_version"] for s in c["weight_versions"]]
        assert len(c["logprobs"]["content"]) == len(c["token_ids"])
        if mode == "keep":  # frozen, then continued on the new weights
            assert len(c["token_ids"]) == LONG and versions == [version - 1, version] and c["policy_version"] == version
        elif mode == "abort":
            assert c["finish_reason"] == "abort" and len(c["token_ids"]) == 2 and versions == [version - 1]
        else:  # the pause (and so the update) waited for them
            assert len(c["token_ids"]) == LONG and versions == [version - 1]


TRAINER = textwrap.dedent(
    """
    import json, sys
    from safetensors.torch import load_file
    from rlserve.client.weights import WeightBroadcaster
    url, port, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    tensors = load_file(ckpt)
    with WeightBroadcaster([url], "127.0.0.1", port, admin_api_key="admin", bucket_bytes=1 << 20) as b:
        print(json.dumps(b.push(sorted(tensors.items()), weight_version="step-7")), flush=True)
    """
)


def trainer_push(url: str, model_dir: Path, timeout: float, trainer: str = TRAINER) -> list[int]:
    """Push `model_dir`'s weights from a trainer process over torch.distributed; the policy versions it got."""
    proc = subprocess.run(
        [sys.executable, "-c", trainer, url, str(free_port()), str(model_dir / "model.safetensors")],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_trainer_push_over_gloo(rl_server, root):
    pushed = make_model("tiny", root / "pushed", seed=4)
    before = httpx.get(f"{rl_server}/metrics", params={"format": "json"}).json()["current_policy_version"]
    assert trainer_push(rl_server, pushed, timeout=180) == [before + 1]
    status = httpx.get(f"{rl_server}/metrics", params={"format": "json"}).json()
    assert status["current_policy_version"] == before + 1 and status["weight_version"] == "step-7"
    for prompt in PROMPTS[:2]:
        hf_check(pushed, prompt, generate(rl_server, prompt)["choices"][0])


def test_mlx_generate_and_metrics_json(rl_server):
    r = httpx.post(
        f"{rl_server}/generate",
        json={"prompt": "hello", "max_tokens": 5, "policy_version": 99, "step_id": 3, "request_id": "abc"},
    )
    assert r.status_code == 200, r.text
    out = r.json()
    current = httpx.get(f"{rl_server}/metrics", params={"format": "json"}).json()["current_policy_version"]
    assert out["request_id"] == "abc" and out["step_id"] == 3 and out["policy_version"] == current
    assert (
        len(out["logprobs"]) == len(out["completion_ids"]) == 5 and out["metadata"]["current_policy_version"] == current
    )
    r = httpx.post(f"{rl_server}/generate", json={"prompt": ["a", "b"], "max_tokens": 2, "request_id": "x"})
    assert [x["request_id"] for x in r.json()["results"]] == ["x-0", "x-1"]
    assert httpx.get(f"{rl_server}/metrics", headers={"Accept": "application/json"}).json()["queue_depth"] == 0
    assert "vllm:num_requests_running" in httpx.get(f"{rl_server}/metrics").text
    assert "rlserve:policy_version" in httpx.get(f"{rl_server}/metrics").text
    trl = httpx.post(
        f"{rl_server}/generate/", json={"prompts": [[1, 2, 3]], "n": 2, "max_tokens": 3, "logprobs": 1}
    ).json()
    assert trl["prompt_ids"] == [[1, 2, 3]] and len(trl["completion_ids"]) == 2 and len(trl["logprobs"][0]) == 3
    sg = httpx.post(
        f"{rl_server}/generate",
        json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 4}, "return_logprob": True},
    ).json()
    assert len(sg["output_ids"]) == 4 and len(sg["meta_info"]["output_token_logprobs"]) == 4
    assert httpx.post(f"{rl_server}/generate", json={"nothing": 1}).status_code == 400


def test_lora_over_http(root, peft_adapter):
    path, peft = peft_adapter
    url, proc = start_server("--weight_roots", json.dumps([str(root)]))
    try:
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)})
        assert r.status_code == 200 and "Success" in r.text
        r = httpx.post(f"{url}/v1/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)})
        assert r.status_code == 400  # exists, and load_inplace is false
        r = httpx.post(f"{url}/load_lora_adapter", json={"lora_name": "policy", "lora_path": str(path)})
        assert r.json()["success"] is True and r.json()["policy_version"] == 2
        assert [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]][1:] == ["policy"]

        def complete(model, prompt, client):
            body = {
                "model": model,
                "prompt": prompt,
                "max_tokens": 6,
                "temperature": 1.0,
                "seed": 3,
                "logprobs": 0,
                "return_token_ids": True,
            }
            return client.post(f"{url}/v1/completions", json=body, timeout=60)

        alone = {}
        with httpx.Client() as client:
            for model in ("policy", None):
                for i, p in enumerate(PROMPTS):
                    alone[(model, i)] = complete(model, p, client).json()["choices"][0]
        for i, prompt in enumerate(PROMPTS):
            c = alone[("policy", i)]
            with torch.no_grad():
                logits = peft(torch.tensor([prompt + c["token_ids"]])).logits[0].float()
            lp = torch.log_softmax(logits[len(prompt) - 1 : -1], -1).gather(
                1, torch.tensor(c["token_ids"]).unsqueeze(1)
            )
            assert torch.allclose(torch.tensor(c["logprobs"]["token_logprobs"]), lp.squeeze(1), atol=1e-4)

        async def mixed():
            async with httpx.AsyncClient() as client:
                jobs = [
                    client.post(
                        f"{url}/v1/completions",
                        json={
                            "model": m,
                            "prompt": p,
                            "max_tokens": 6,
                            "temperature": 1.0,
                            "seed": 3,
                            "logprobs": 0,
                            "return_token_ids": True,
                        },
                        timeout=60,
                    )
                    for m in ("policy", None)
                    for p in PROMPTS
                ]
                return [r.json()["choices"][0] for r in await asyncio.gather(*jobs)]

        together = asyncio.run(mixed())
        keys = [(m, i) for m in ("policy", None) for i in range(len(PROMPTS))]
        for key, c in zip(keys, together):
            assert c["token_ids"] == alone[key]["token_ids"]
        assert httpx.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "policy"}).status_code == 200
        assert (
            httpx.post(f"{url}/v1/completions", json={"model": "policy", "prompt": [1], "max_tokens": 1}).status_code
            == 404
        )
        r = httpx.post(f"{url}/load_adapter", json={"adapter_path": str(path)})
        assert r.json()["status"] == "success" and r.json()["policy_version"] == 3
    finally:
        stop_server(proc)


def test_chat_completions_tokens_uses_the_ids_verbatim(server):
    messages = [{"role": "user", "content": "hi there"}]
    rendered = httpx.post(f"{server}/tokenize", json={"messages": messages, "add_generation_prompt": True}).json()[
        "tokens"
    ]
    tokens = rendered[:-2] + [7, 8] + rendered[-2:]  # differs from the rendering: used anyway
    body = {
        "messages": messages,
        "tokens": tokens,
        "max_tokens": 4,
        "logprobs": True,
        "return_token_ids": True,
        "seed": 1,
    }
    out = httpx.post(f"{server}/v1/chat/completions/tokens", json=body, timeout=60).json()
    assert out["prompt_token_ids"] == tokens and len(out["choices"][0]["token_ids"]) == 4
    assert len(out["choices"][0]["logprobs"]["content"]) == 4
    plain = httpx.post(
        f"{server}/inference/v1/generate",
        json={"token_ids": tokens, "sampling_params": {"max_tokens": 4, "seed": 1, "logprobs": 0}},
    ).json()
    assert plain["choices"][0]["token_ids"] == out["choices"][0]["token_ids"]
    r = httpx.post(f"{server}/v1/chat/completions/tokens", json={**body, "tokens": [1] * 600})
    assert r.status_code == 400 and "maximum context length is 512 tokens" in r.json()["error"]["message"]


def test_sglang_and_trl_control_aliases(rl_server, root):
    assert httpx.get(f"{rl_server}/get_world_size/").json() == {"world_size": 1}
    info = httpx.get(f"{rl_server}/get_model_info").json()
    assert info["is_generation"] is True
    r = httpx.post(f"{rl_server}/update_weight_version", json={"new_version": "step-42"}, headers=ADMIN)
    assert r.json()["success"] is True
    assert httpx.get(f"{rl_server}/get_weight_version").json()["weight_version"] == "step-42"
    choice = generate(rl_server, PROMPTS[2])["choices"][0]
    assert choice["weight_version"] == "step-42"
    target = make_model("tiny", root / "sglang", seed=5)
    r = httpx.post(
        f"{rl_server}/update_weights_from_disk",
        json={"model_path": str(target), "weight_version": "step-43"},
        headers=ADMIN,
        timeout=60,
    )
    assert (
        r.json()["success"] is True
        and httpx.get(f"{rl_server}/get_weight_version").json()["weight_version"] == "step-43"
    )
    assert (
        httpx.post(f"{rl_server}/pause_generation", json={"mode": "in_place"}, headers=ADMIN).json()["status"] == "ok"
    )
    assert httpx.get(f"{rl_server}/is_paused").json() == {"is_paused": True}
    assert httpx.post(f"{rl_server}/continue_generation", json={}, headers=ADMIN).json()["status"] == "ok"
    assert httpx.post(f"{rl_server}/flush_cache", headers=ADMIN).status_code == 200
    assert httpx.post(f"{rl_server}/abort_request", json={"rid": "nope"}, headers=ADMIN).status_code == 200
