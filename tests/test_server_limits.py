"""Request caps and big inputs at the HTTP boundary (issue 20): the server refuses early, keeps answering
/health meanwhile, and its memory does not ratchet; -inf logprobs never break JSON. Rows of
docs/errors.md that need their own server settings live here."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from conftest import assert_documented_error, start_server, stop_server

USER = [{"role": "user", "content": "x"}]
HANG_GUARD_S = 120


@pytest.fixture(scope="module")
def limited() -> Iterator[tuple[str, int]]:
    # processed logprobs (not vLLM's raw default): the tests of -inf and logit_bias look at the sampled distribution
    url, proc = start_server(
        "--server.max_waiting_requests",
        "1",
        "--server.trust_request_chat_template",
        "true",
        "--engine.logprobs_mode",
        "processed_logprobs",
    )
    try:
        yield url, proc.pid
    finally:
        stop_server(proc)


def strict_json(text: str):
    """JSON as the standard defines it: NaN and Infinity are not numbers there."""
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))


def test_health_answers_while_a_10mb_body_streams_in_and_is_refused(limited) -> None:
    url, _ = limited
    more, result = threading.Event(), {}

    def body() -> Iterator[bytes]:
        yield b'{"prompt": "' + b"a" * (1 << 20)
        more.wait(HANG_GUARD_S)  # the big request cannot finish before /health has answered
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'

    def send() -> None:
        result["response"] = httpx.post(
            f"{url}/v1/completions", content=body(), timeout=HANG_GUARD_S, headers={"content-type": "application/json"}
        )

    sender = threading.Thread(target=send)
    sender.start()
    try:
        assert httpx.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200
        assert sender.is_alive()
    finally:
        more.set()
        sender.join(HANG_GUARD_S)
    r = result["response"]
    assert r.status_code == 413 and "server.max_body_bytes" in r.json()["error"]["message"]
    assert httpx.get(f"{url}/health", timeout=HANG_GUARD_S).status_code == 200


def test_declared_size_over_the_cap_is_refused_before_the_body_is_read(limited) -> None:
    url, _ = limited
    host, port = url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=HANG_GUARD_S) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 10485760\r\n\r\n"
        )  # no body follows: the answer must not wait for it
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # the server closes the connection after it
    assert answer.startswith(b"HTTP/1.1 413") and b"server.max_body_bytes" in answer


def test_memory_does_not_ratchet_with_repeated_big_prompts(limited) -> None:
    url, pid = limited
    prompt = "word " * (1_500_000)  # 7.5 MB, under the 8 MiB body cap

    def rss_mb() -> float:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        pytest.skip("no /proc here")

    with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        for i in range(12):
            r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and "maximum context length is 512 tokens" in r.json()["error"]["message"]
            if i == 3:
                warm = rss_mb()
        # a few body-sized buffers may stay with the allocator; a ratchet would add ~8 more of them
        assert rss_mb() - warm < 40


def test_full_waiting_queue_answers_429_with_retry_after(limited) -> None:
    url, _ = limited
    held: dict = {}
    with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        assert http.post("/pause", params={"mode": "keep"}).status_code == 200
        try:
            waiter = threading.Thread(
                target=lambda: held.update(
                    r=httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=HANG_GUARD_S)
                )
            )
            waiter.start()
            for _ in range(HANG_GUARD_S * 10):  # until the held request sits in the waiting queue
                if http.get("/metrics", params={"format": "json"}).json()["queue_depth"] >= 1:
                    break
                threading.Event().wait(0.1)
            r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "server.max_waiting_requests" in r.json()["error"]["message"]
        finally:
            http.post("/resume")
        waiter.join(HANG_GUARD_S)
        assert held["r"].status_code == 200
    assert_documented_error("waiting-queue-full", "/v1/completions", 429, "server.max_waiting_requests")


def test_request_chat_template_when_trusted(limited) -> None:
    url, _ = limited
    with httpx.Client(base_url=url, timeout=HANG_GUARD_S) as http:
        ok = http.post(
            "/v1/chat/completions",
            json={
                "messages": USER,
                "max_tokens": 1,
                "return_token_ids": True,
                "chat_template": "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            },
        )
        assert ok.status_code == 200, ok.text
        empty = http.post("/v1/chat/completions", json={"messages": USER, "chat_template": "{# nothing #}"})
        assert empty.status_code == 400 and "rendered nothing" in empty.json()["error"]["message"]
        assert_documented_error("template-renders-nothing", "/v1/chat/completions", 400, "rendered nothing")
        loop = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
        slow = http.post("/v1/chat/completions", json={"messages": USER, "chat_template": loop})
        assert slow.status_code == 400 and "took longer than" in slow.json()["error"]["message"]
        assert slow.json()["error"]["param"] == "chat_template"
        assert_documented_error("template-too-slow", "/v1/chat/completions", 400, "took longer than")
        assert http.get("/health").status_code == 200
        assert http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1}).status_code == 200


def test_minus_inf_logprobs_are_json_on_every_route(limited) -> None:
    """top_k 1 leaves every other token at -inf: -9999.0 in OpenAI shapes (vLLM), null in TRL legacy."""
    server, _ = limited
    greedy = {"top_k": 1, "max_tokens": 3}
    with httpx.Client(base_url=server, timeout=HANG_GUARD_S) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "logprobs": 3, "prompt_logprobs": 3, **greedy})
        tops = strict_json(r.text)["choices"][0]["logprobs"]["top_logprobs"]
        assert all(-9999.0 in top.values() for top in tops)
        r = http.post("/v1/chat/completions", json={"messages": USER, "logprobs": True, "top_logprobs": 3, **greedy})
        content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
        assert all(any(t["logprob"] == -9999.0 for t in c["top_logprobs"]) for c in content)
        r = http.post(
            "/inference/v1/generate", json={"token_ids": [1, 2], "sampling_params": {"logprobs": 3, **greedy}}
        )
        content = strict_json(r.text)["choices"][0]["logprobs"]["content"]
        assert all(any(t["logprob"] == -9999.0 for t in c["top_logprobs"]) for c in content)
        r = http.post("/generate", json={"prompts": [[1, 2]], "logprobs": 5, **greedy})
        assert r.status_code == 200, r.text
        rows = strict_json(r.text)["logprobs"][0]
        assert all(row[0] == 0.0 and row[1:] == [None] * 4 for row in rows)
        r = http.post(
            "/generate",
            json={
                "input_ids": [1, 2],
                "return_logprob": True,
                "top_logprobs_num": 3,
                "sampling_params": {"top_k": 1, "max_new_tokens": 3},
            },
        )
        assert r.status_code == 200 and strict_json(r.text)["meta_info"]["output_token_logprobs"]
        r = http.post("/generate", json={"prompt": "x", "top_k": 1, "max_tokens": 3})
        assert r.status_code == 200 and len(strict_json(r.text)["logprobs"]) == 3


def test_non_latin1_request_id_is_echoed(server: str) -> None:
    with httpx.Client(base_url=server, timeout=HANG_GUARD_S) as http:
        r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "request_id": "中"})
        assert r.status_code == 200 and r.json()["id"] == "cmpl-中"
        assert r.headers["x-request-id"] == "%E4%B8%AD"
        r = http.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "request_id": "a\nb"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "a%0Ab"


def test_huge_logit_bias_is_clamped_like_vllm(limited) -> None:
    """1e300 acts as +100: the biased token wins every step, with a real logprob, not -9999."""
    server, _ = limited
    with httpx.Client(base_url=server, timeout=HANG_GUARD_S) as http:
        r = http.post(
            "/v1/completions",
            json={
                "prompt": "x",
                "max_tokens": 4,
                "logprobs": 0,
                "return_token_ids": True,
                "logit_bias": {"5": 1e300},
                "ignore_eos": True,
            },
        )
        choice = strict_json(r.text)["choices"][0]
        assert choice["token_ids"] == [5] * 4
        assert all(-1e-3 < lp <= 0 for lp in choice["logprobs"]["token_logprobs"])


def test_unknown_fields_stay_ignored_on_typed_native_routes(server: str) -> None:
    with httpx.Client(base_url=server, timeout=HANG_GUARD_S) as http:
        r = http.post("/generate", json={"prompt": "x", "max_tokens": 1, "novel": {"a": [1]}})
        assert r.status_code == 200, r.text
        r = http.post(
            "/inference/v1/generate",
            json={"token_ids": [1], "sampling_params": {"max_tokens": 1, "new": 1}, "features": None, "extra": True},
        )
        assert r.status_code == 200, r.text
        r = http.post("/abort_requests", json={"request_ids": ["nope"], "whatever": 1})
        assert r.status_code == 200, r.text
        r = http.post(
            "/generate",
            content=json.dumps({"prompt": "x", "max_tokens": 1}),
            headers={"content-type": "application/x-www-form-urlencoded"},
        )  # curl -d
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("field, value", [("rank_offset", 2**70), ("inference_world_size", 2**64), ("timeout", 1e300)])
def test_init_broadcaster_refuses_numbers_no_process_group_takes(server: str, field: str, value) -> None:
    """Found by the fuzzer: a rank past 64 bits reached the engine's message encoding and came back a 500."""
    body = {"host": "127.0.0.1", "port": 1, "rank_offset": 0, "inference_world_size": 1, "timeout": 1, field: value}
    r = httpx.post(f"{server}/init_broadcaster", json=body, timeout=HANG_GUARD_S)
    assert r.status_code == 400 and field in r.text, r.text


def test_openapi_describes_every_body_with_this_servers_caps(server: str) -> None:
    spec = httpx.get(f"{server}/openapi.json", timeout=HANG_GUARD_S).json()
    for path in (
        "/generate",
        "/inference/v1/generate",
        "/update_weights",
        "/init_broadcaster",
        "/abort_requests",
        "/v1/load_lora_adapter",
        "/load_adapter",
        "/update_weights_from_disk",
        "/v1/completions",
    ):
        assert "requestBody" in spec["paths"][path]["post"], path
    generate = spec["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert {r["$ref"].rsplit("/", 1)[1] for r in generate["anyOf"]} == {
        "TRLGenerateRequest",
        "SGLangGenerateRequest",
        "MLXGenerateRequest",
    }
    schemas = spec["components"]["schemas"]
    assert schemas["CompletionRequest"]["properties"]["n"]["maximum"] == 256  # engine.max_num_seqs
    assert schemas["CompletionRequest"]["properties"]["temperature"]["minimum"] == 0
    token_ids = schemas["InferenceGenerateRequest"]["properties"]["token_ids"]
    vocab = httpx.post(f"{server}/tokenize", json={"prompt": "x"}, timeout=HANG_GUARD_S)
    assert vocab.status_code == 200 and token_ids["items"]["maximum"] > 0 and token_ids["minItems"] == 1
    assert schemas["InitBroadcasterRequest"]["properties"]["port"]["anyOf"][0]["maximum"] == 65535
