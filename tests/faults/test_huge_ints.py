"""Integers outside 64 bits in every generation route's fields, against the default server (engine core
process): each answers 200 (where a larger value means the same as the largest) or a 400 naming the field,
never a 500, and none of them is counted as an aborted request."""

from __future__ import annotations

import httpx
import pytest

from conftest import start_server, stop_server

BIG, HUGE, VAST = 2**64, 2**70, 2**200
USER = [{"role": "user", "content": "x"}]

# (case, route, body, status, field named in the 400's message; None for a 200)
CASES = [
    # over the context: vLLM's 400 "max_tokens=... cannot be greater than max_model_len" (docs/vllm-compat.md)
    ("max-tokens", "/v1/completions", {"prompt": "x", "max_tokens": BIG}, 400, "max_tokens"),
    ("top-k", "/v1/completions", {"prompt": "x", "max_tokens": 2, "top_k": HUGE}, 200, None),
    ("seed", "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": VAST}, 200, None),
    ("seed-negative", "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": -VAST}, 200, None),
    ("min-tokens", "/v1/completions", {"prompt": "x", "min_tokens": HUGE}, 200, None),
    (
        "logit-bias",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "logit_bias": {str(HUGE): 1}},
        400,
        "logit_bias",
    ),
    (
        "stop-token-ids",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "stop_token_ids": [HUGE]},
        400,
        "stop_token_ids",
    ),
    ("logprobs", "/v1/completions", {"prompt": "x", "max_tokens": 2, "logprobs": HUGE}, 400, "logprobs"),
    (
        "prompt-logprobs",
        "/v1/completions",
        {"prompt": "x", "max_tokens": 2, "prompt_logprobs": HUGE},
        400,
        "prompt_logprobs",
    ),
    ("prompt-ids", "/v1/completions", {"prompt": [1, HUGE], "max_tokens": 2}, 400, "prompt"),
    ("prompt-ids-negative", "/v1/completions", {"prompt": [1, -HUGE], "max_tokens": 2}, 400, "prompt"),
    ("chat-max-tokens", "/v1/chat/completions", {"messages": USER, "max_tokens": BIG}, 400, "max_tokens"),
    (
        "chat-max-completion-tokens",
        "/v1/chat/completions",
        {"messages": USER, "max_completion_tokens": HUGE},
        400,
        "max_completion_tokens",
    ),
    ("chat-top-k", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "top_k": HUGE}, 200, None),
    ("chat-seed", "/v1/chat/completions", {"messages": USER, "max_tokens": 2, "seed": VAST}, 200, None),
    (
        "chat-logit-bias",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "logit_bias": {str(HUGE): 5}},
        400,
        "logit_bias",
    ),
    (
        "chat-stop-token-ids",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "stop_token_ids": [HUGE]},
        400,
        "stop_token_ids",
    ),
    ("chat-min-tokens", "/v1/chat/completions", {"messages": USER, "min_tokens": HUGE}, 200, None),
    (
        "chat-prompt-logprobs",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "prompt_logprobs": HUGE},
        400,
        "prompt_logprobs",
    ),
    (
        "chat-stream-seed",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "seed": VAST, "stream": True},
        200,
        None,
    ),
    (
        "chat-stream-logit-bias",
        "/v1/chat/completions",
        {"messages": USER, "max_tokens": 2, "logit_bias": {str(HUGE): 5}, "stream": True},
        400,
        "logit_bias",
    ),
    (
        "responses-max-output-tokens",
        "/v1/responses",
        {"input": "hi", "max_output_tokens": BIG},
        400,
        "max_output_tokens",
    ),
    ("responses-top-k", "/v1/responses", {"input": "hi", "max_output_tokens": 2, "top_k": HUGE}, 200, None),
    ("inference-token-ids", "/inference/v1/generate", {"token_ids": [1, HUGE]}, 400, "token_ids"),
    (
        "inference-max-tokens",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": BIG}},
        200,
        None,
    ),
    (
        "inference-seed",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "seed": VAST}},
        200,
        None,
    ),
    (
        "inference-top-k",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "top_k": HUGE}},
        200,
        None,
    ),
    (
        "inference-logit-bias",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "logit_bias": {str(HUGE): 1}}},
        400,
        "logit_bias",
    ),
    (
        "inference-stop-token-ids",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "stop_token_ids": [HUGE]}},
        400,
        "stop_token_ids",
    ),
    (
        "inference-logprobs",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "logprobs": HUGE}},
        400,
        "logprobs",
    ),
    (
        "inference-prompt-logprobs",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2, "prompt_logprobs": HUGE}},
        400,
        "prompt_logprobs",
    ),
    (
        "inference-min-tokens",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"min_tokens": HUGE}},
        200,
        None,
    ),
    (
        "inference-kv-transfer-params",
        "/inference/v1/generate",
        {"token_ids": [1], "sampling_params": {"max_tokens": 2}, "kv_transfer_params": {"x": HUGE}},
        400,
        "kv_transfer_params",
    ),
    ("trl-prompt-ids", "/generate", {"prompts": [[1, HUGE]]}, 400, "prompts"),
    ("trl-max-tokens", "/generate", {"prompts": [[1, 2]], "max_tokens": BIG}, 200, None),
    ("trl-top-k", "/generate", {"prompts": [[1, 2]], "max_tokens": 2, "top_k": HUGE}, 200, None),
    ("trl-seed", "/generate", {"prompts": [[1, 2]], "max_tokens": 2, "generation_kwargs": {"seed": VAST}}, 200, None),
    ("trl-logprobs", "/generate", {"prompts": [[1, 2]], "max_tokens": 2, "logprobs": HUGE}, 400, "logprobs"),
    (
        "trl-stop-token-ids",
        "/generate",
        {"prompts": [[1, 2]], "max_tokens": 2, "generation_kwargs": {"stop_token_ids": [HUGE]}},
        400,
        "stop_token_ids",
    ),
    ("sglang-input-ids", "/generate", {"input_ids": [1, HUGE]}, 400, "input_ids"),
    (
        "sglang-max-new-tokens",
        "/generate",
        {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": BIG}},
        200,
        None,
    ),
    (
        "sglang-top-logprobs-num",
        "/generate",
        {
            "input_ids": [1, 2],
            "return_logprob": True,
            "top_logprobs_num": HUGE,
            "sampling_params": {"max_new_tokens": 2},
        },
        400,
        "logprobs",
    ),
    ("mlx-max-tokens", "/generate", {"prompt": "x", "max_tokens": BIG}, 200, None),
    ("mlx-seed", "/generate", {"prompt": "x", "max_tokens": 2, "seed": VAST}, 200, None),
]


@pytest.fixture(scope="module")
def server():
    url, proc = start_server("--model.max_model_len", "64")  # short context: a max_tokens past it ends soon
    try:
        yield url
    finally:
        stop_server(proc)


def _aborted(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line
    )


def test_huge_integers_are_answered_without_a_5xx(server: str) -> None:
    aborted_before = _aborted(server)
    wrong = []
    with httpx.Client(base_url=server, timeout=120) as client:
        for case, route, body, status, field in CASES:
            try:
                resp = client.post(route, json=body)
            except httpx.HTTPError as exc:
                wrong.append(f"{case}: {exc!r}")
                continue
            text = resp.text
            ok = resp.status_code == status and (field is None or field in resp.json()["error"]["message"])
            if status == 200 and body.get("stream"):
                ok = ok and '"error"' not in text
            if not ok:
                wrong.append(f"{case}: {resp.status_code} {text[:200]}")
    assert not wrong, "\n".join(wrong)
    assert _aborted(server) == aborted_before
    assert httpx.get(f"{server}/health", timeout=30).status_code == 200


def test_clamped_integers_mean_what_the_in_thread_engine_makes_of_them(server: str) -> None:
    """A seed past 64 bits samples as the engine's own reduction of it (mod 2**63); a max_tokens past the
    context generates to the end of the context, as max_tokens null does."""
    with httpx.Client(base_url=server, timeout=120) as client:

        def tokens(**fields) -> list[int]:
            body = {"token_ids": [1, 2, 3], "sampling_params": {"temperature": 1.0, **fields}}
            resp = client.post("/inference/v1/generate", json=body)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["token_ids"]

        assert tokens(seed=VAST, max_tokens=8) == tokens(seed=VAST % 2**63, max_tokens=8)
        assert tokens(seed=7, max_tokens=BIG, ignore_eos=True) == tokens(seed=7, ignore_eos=True)
