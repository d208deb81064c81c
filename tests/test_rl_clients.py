"""RL clients no one here wrote, against a real server.

- verifiers' `renderers` client (the package as published) over /inference/v1/generate;
- TRL's VLLMClient (as published, pinned in the test extra) for generation, and its weight-sync requests
  replayed exactly (they need vLLM's NCCL trainer engine, which needs CUDA and vLLM);
- NeMo Gym's vLLM model server (Python >= 3.12 only): its chat + /tokenize requests replayed from
  responses_api_models/vllm_model/app.py 0.4.0, asserting every field it reads.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server
from rlserve.model.make import default_model_dir, make_model
from rlserve.runtime.ports import free_port


@pytest.fixture(scope="module")
def url(root):
    # vLLM's update_info transfer receives into the server process: the in-thread engine
    url, proc = start_server("--weight_roots", json.dumps([str(root)]), "--engine.core_process", "false")
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(default_model_dir(), dtype=torch.float32).eval()


def forward_logprobs(model, prompt_ids: list[int], completion_ids: list[int]) -> list[float]:
    ids = torch.tensor([prompt_ids + completion_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
    n = len(prompt_ids)
    return [logp[n - 1 + i, t].item() for i, t in enumerate(completion_ids)]


def test_verifiers_renderers_two_turns(url, hf):
    """verifiers' TrainClient path: renderers builds the Qwen3 renderer from the model's tokenizer,
    renders the chat itself, calls /inference/v1/generate through renderers.client.generate (which
    insists on `token_id:<id>` tokens and finite logprobs), and bridges turn 2 onto turn 1's exact
    prompt + completion tokens."""
    renderers = pytest.importorskip("renderers")
    from openai import AsyncOpenAI
    from renderers.base import load_tokenizer
    from renderers.client import generate

    renderer = renderers.create_renderer(
        load_tokenizer(str(default_model_dir())), renderers.Qwen3RendererConfig(enable_thinking=False)
    )
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 3}

    async def two_turns():
        first = await generate(
            client=client, renderer=renderer, messages=messages, model="rlserve-default", sampling_params=sampling
        )
        tail = [{"role": "user", "content": "Another one?"}]
        bridged = renderer.bridge_to_next_turn(first["prompt_ids"], first["completion_ids"], tail)
        history = messages + [{"role": "assistant", "content": first["content"] or ""}] + tail
        second = await generate(
            client=client,
            renderer=renderer,
            messages=history,
            model="rlserve-default",
            prompt_ids=bridged.token_ids if bridged is not None else None,
            sampling_params={**sampling, "seed": 4},
        )
        await client.close()
        return first, second, bridged

    first, second, bridged = asyncio.run(two_turns())
    for turn in (first, second):
        assert turn["completion_ids"] and len(turn["completion_logprobs"]) == len(turn["completion_ids"])
        assert turn["finish_reason"] in ("stop", "length")
        ref = forward_logprobs(hf, turn["prompt_ids"], turn["completion_ids"])
        assert max(abs(a - b) for a, b in zip(turn["completion_logprobs"], ref)) < 1e-4
    # turn 2 extends turn 1's tokens as sampled (no re-tokenization drift)
    assert bridged is not None
    stem = first["prompt_ids"] + first["completion_ids"]
    assert second["prompt_ids"][: len(stem)] == stem
    # the renderer's own rendering is the server's
    served = httpx.post(
        f"{url}/tokenize",
        json={"messages": messages, "add_generation_prompt": True, "chat_template_kwargs": {"enable_thinking": False}},
    ).json()["tokens"]
    assert first["prompt_ids"] == served


def test_generate_logprob_tokens_like_vllm(url):
    """vLLM's /inference/v1/generate names tokens token_id:<id> (no flag needed) and lists the
    sampled token first in top_logprobs."""
    body = {
        "token_ids": [11, 22, 33],
        "sampling_params": {"max_tokens": 5, "logprobs": 3, "seed": 1, "ignore_eos": True},
    }
    choice = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    for t, entry in zip(choice["token_ids"], choice["logprobs"]["content"]):
        assert entry["token"] == f"token_id:{t}"
        assert len(entry["top_logprobs"]) == 3
        # vLLM 0.32's {token_id, logprob, rank}, with verifiers' token_id:<id> name beside it
        first = entry["top_logprobs"][0]
        assert first["token_id"] == t and first["token"] == f"token_id:{t}" and first["logprob"] == entry["logprob"]
        assert [e["rank"] for e in entry["top_logprobs"]][1:] == sorted(e["rank"] for e in entry["top_logprobs"][1:])
        rest = [e["logprob"] for e in entry["top_logprobs"][1:]]
        assert rest == sorted(rest, reverse=True)


# ---- NeMo Gym responses_api_models/vllm_model (0.4.0), replayed -----------------------------------


def test_nemo_gym_vllm_model_requests(url, hf):
    history_assistant = {
        "role": "assistant",
        "content": "Paris.",
        "reasoning_content": "capital",
        "reasoning": "capital",
    }
    messages = [
        {"role": "user", "content": "Capital of France?"},
        history_assistant,
        {"role": "user", "content": "And of Italy?"},
    ]
    kwargs = {"enable_thinking": False}
    # _preprocess_chat_completion_create_params with return_token_id_information=True
    body = {
        "model": "rlserve-default",
        "messages": messages,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 2,
        "chat_template_kwargs": kwargs,
        "logprobs": True,
        "top_logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    with httpx.Client(base_url=url, timeout=60) as http:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        message = choice["message"]
        assert message["role"] == "assistant" and "content" in message
        assert choice["finish_reason"] in ("stop", "length")
        assert {"prompt_tokens", "completion_tokens", "total_tokens"} <= data["usage"].keys()
        assert {"id", "object", "created", "model"} <= data.keys()
        log_probs = choice["logprobs"]["content"]
        generation_token_ids = [int(lp["token"].removeprefix("token_id:")) for lp in log_probs]
        generation_log_probs = [lp["logprob"] for lp in log_probs]
        # the prompt ids come from a second call to /tokenize at the root, with the same template knobs
        tokens = http.post(
            "/tokenize", json={"model": "rlserve-default", "messages": messages, "chat_template_kwargs": kwargs}
        ).json()["tokens"]
        ref = forward_logprobs(hf, tokens, generation_token_ids)
        assert max(abs(a - b) for a, b in zip(generation_log_probs, ref)) < 1e-4

        # turn 2 for training: the earlier assistant turn carries its exact tokens
        trained = {
            **history_assistant,
            "prompt_token_ids": tokens,
            "generation_token_ids": generation_token_ids,
            "generation_log_probs": generation_log_probs,
        }
        body2 = {
            **body,
            "messages": messages + [{**trained, "content": message["content"]}, {"role": "user", "content": "Thanks."}],
            "return_token_ids": True,
        }
        r2 = http.post("/v1/chat/completions", json=body2)
        assert r2.status_code == 200, r2.text
        prompt2 = r2.json()["prompt_token_ids"]
        assert prompt2[: len(tokens) + len(generation_token_ids)] == tokens + generation_token_ids

        # an overlong prompt becomes a `length` turn in NeMo Gym: it looks for these words in a 400
        long = {**body, "messages": [{"role": "user", "content": "word " * 2000}]}
        r3 = http.post("/v1/chat/completions", json=long)
        assert r3.status_code == 400 and ("context length" in r3.text or "max_tokens" in r3.text)


# ---- TRL ------------------------------------------------------------------------------------------


def test_trl_vllm_client_generation(url):
    """TRL's own VLLMClient, with its "vLLM installed" gate bypassed (only its weight sync needs vLLM)."""
    vllm_client = pytest.importorskip("trl.generation.vllm_client")
    vllm_client.is_vllm_available = lambda *a, **k: True
    client = vllm_client.VLLMClient(base_url=url)
    out = client.generate([[11, 22, 33], [44, 55]], n=2, max_tokens=4, logprobs=1, generation_kwargs={"seed": 0})
    assert out["prompt_ids"] == [[11, 22, 33], [44, 55]]
    assert len(out["completion_ids"]) == 4 and all(len(c) == 4 or len(c) < 4 for c in out["completion_ids"])
    for ids, lps, lp_ids in zip(out["completion_ids"], out["logprobs"], out["logprob_token_ids"]):
        assert len(lps) == len(ids) == len(lp_ids)
        # TRL sorts the sampled token and its alternatives by probability
        assert all(t in row_ids and row == sorted(row, reverse=True) for row_ids, row, t in zip(lp_ids, lps, ids))
    chat = client.chat([[{"role": "user", "content": "hi"}]], max_tokens=3, logprobs=0)
    assert len(chat["completion_ids"]) == 1 and chat["prompt_ids"][0]
    assert client.get_world_size() == 1
    client.reset_prefix_cache()
    info = client.get_server_info()
    assert info["weight_transfer_config"] is not None


# TRL's VLLMClient weight sync (init_communicator, weight_update, update_named_param,
# update_model_params), as HTTP calls; the broadcast follows vLLM's packed producer
# (chunks close once their size exceeds the buffer) over a torch.distributed group.
TRL_TRAINER = textwrap.dedent(
    """
    import json, sys
    from concurrent.futures import ThreadPoolExecutor
    import requests, torch
    import torch.distributed as dist
    from safetensors.torch import load_file
    from rlserve.weight_transfer import init_group

    base, port, ckpt = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    session = requests.Session()

    def post(path, body):
        r = session.post(base + path, json=body)
        assert r.status_code == 200, (path, r.status_code, r.text)
        return r.json()

    info = session.get(base + "/server_info", params={"config_format": "json"}).json()["vllm_config"]
    assert info["weight_transfer_config"] is not None
    world_size = session.get(base + "/get_world_size").json()["world_size"] + 1
    init_info = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": world_size,
                 "packed": True}
    with ThreadPoolExecutor(1) as pool:
        joined = pool.submit(post, "/init_weight_transfer_engine", {"init_info": init_info})
        init_group("127.0.0.1", port, 0, world_size, 120)
        print(json.dumps(joined.result()), flush=True)

    def packed_broadcast(tensors, buffer_bytes):
        chunk, size = [], 0
        for t in tensors:
            chunk.append(t.contiguous().view(torch.uint8).view(-1))
            size += chunk[-1].numel()
            if size > buffer_bytes:
                dist.broadcast(torch.cat(chunk), src=0)
                chunk, size = [], 0
        if chunk:
            dist.broadcast(torch.cat(chunk), src=0)

    def update_named_params(named, extra=None, buffer_bytes=1 << 30):
        info = {"names": [n for n, _ in named], "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in named],
                "shapes": [list(t.shape) for _, t in named], **(extra or {})}
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(post, "/update_weights", {"update_info": info})
            packed_broadcast([t for _, t in named], buffer_bytes)
            return done.result()

    def version():
        return session.get(base + "/metrics", params={"format": "json"}).json()["current_policy_version"]

    tensors = sorted(load_file(ckpt).items())
    v0 = version()
    # `with client.weight_update(): client.update_named_param(...)` per tensor: one commit at the end
    print(json.dumps(post("/start_weight_update", {})), flush=True)
    for name, t in tensors[:3]:
        update_named_params([(name, t)])
    assert version() == v0, "tensors went live before /finish_weight_update"
    print(json.dumps(post("/finish_weight_update", {})), flush=True)
    assert version() == v0 + 1
    # update_model_params: start, one update_weights for every tensor (small chunks), finish
    post("/start_weight_update", {})
    update_named_params(tensors, {"packed_buffer_size_bytes": 1 << 18}, buffer_bytes=1 << 18)
    post("/finish_weight_update", {})
    assert version() == v0 + 2
    r = session.post(base + "/reset_prefix_cache")
    assert r.status_code == 200 and "success" in r.json()
    print("ok", flush=True)
    """
)


def test_trl_weight_sync_requests(url, root):
    pushed = make_model("tiny", root / "trl-pushed", seed=5)
    proc = subprocess.run(
        [sys.executable, "-c", TRL_TRAINER, url, str(free_port()), str(pushed / "model.safetensors")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr + proc.stdout
    lines = proc.stdout.strip().splitlines()
    assert json.loads(lines[0]) == {"message": "Weight transfer initialized"}
    assert json.loads(lines[1]) == {"message": "Weight update started"}
    assert json.loads(lines[2])["message"] == "Weight update finished"
    assert lines[-1] == "ok"
    # the server now serves exactly the pushed weights
    hf = AutoModelForCausalLM.from_pretrained(pushed, dtype=torch.float32).eval()
    body = {
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 6, "seed": 0, "ignore_eos": True, "logprobs": 0},
    }
    choice = httpx.post(f"{url}/inference/v1/generate", json=body, timeout=60).json()["choices"][0]
    ref = forward_logprobs(hf, [5, 6, 7, 8], choice["token_ids"])
    assert max(abs(e["logprob"] - r) for e, r in zip(choice["logprobs"]["content"], ref)) < 1e-4


def test_weight_transfer_routes_reject_bad_input(url):
    with httpx.Client(base_url=url, timeout=30) as http:
        r = http.post("/init_weight_transfer_engine", json={"init_info": {"master_address": "127.0.0.1"}})
        assert r.status_code == 400 and "master_port" in r.json()["error"]["message"]
        r = http.post(
            "/update_weights", json={"update_info": {"names": ["x"], "dtype_names": ["int8"], "shapes": [[1]]}}
        )
        assert r.status_code in (400, 409)
        r = http.post("/update_weights", json={"update_info": "nope"})
        assert r.status_code == 400
        assert http.get("/health").status_code == 200
