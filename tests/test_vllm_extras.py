"""Small vLLM 0.32 server features: X-Request-Id on every response, --root-path, /tokenizer_info, SageMaker's
/invocations and POST /ping, the ORCA `endpoint-load-metrics` header, and the request parameters vLLM takes
that rlserve honours (truncation_side, -1 logprobs, chat echo, custom roles) or refuses by name
(use_beam_search, logprob_token_ids). One server, started as a vLLM launch line would start it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from conftest import start_server, stop_server

ADMIN = "admin-key"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    base, proc = start_server(
        "--root-path",
        "/llm",
        "--max-logprobs",
        "4096",
        "--enable-request-id-headers",
        "--server.admin_api_key",
        ADMIN,
        "--server.trust_request_chat_template",
        "true",
    )
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=60) as c:
        yield c


def chat(http: httpx.Client, path: str = "/v1/chat/completions", **fields) -> httpx.Response:
    return http.post(path, json={"messages": USER, "max_tokens": 2, "temperature": 0, **fields})


def test_request_id_on_every_response(http: httpx.Client) -> None:
    answers = [
        http.get("/health"),
        http.get("/metrics"),
        http.get("/no/such/route"),
        chat(http, n=0),
        http.post("/pause"),  # 401: the admin key is missing
        chat(http),
    ]
    assert [r.status_code for r in answers] == [200, 200, 404, 400, 401, 200]
    ids = [r.headers.get("x-request-id") for r in answers]
    assert all(ids) and len(set(ids)) == len(ids)
    r = http.get("/v1/models", headers={"X-Request-Id": "mine-1"})
    assert r.headers.get_list("x-request-id") == ["mine-1"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "mine-2"})
    assert r.headers.get_list("x-request-id") == ["mine-2"] and r.json()["id"] == "cmpl-mine-2"


def test_root_path_serves_both_forms_and_keeps_admin_keys(http: httpx.Client) -> None:
    assert http.get("/llm/v1/models").status_code == 200
    assert http.get("/v1/models").status_code == 200
    assert chat(http, "/llm/v1/chat/completions").json()["object"] == "chat.completion"
    # an admin route under the prefix is the same admin route: the key is still needed
    for path in ("/llm/pause", "/llm/pause/", "/pause"):
        assert http.post(path).status_code == 401, path
    headers = {"Authorization": f"Bearer {ADMIN}"}
    assert http.post("/llm/pause", headers=headers).status_code == 200
    assert http.post("/llm/resume", headers=headers).status_code == 200


def test_tokenizer_info(http: httpx.Client) -> None:
    info = http.get("/tokenizer_info").json()
    assert info["tokenizer_class"] and "vocab_file" not in info and "merges_file" not in info
    assert info["eos_token"] == "<|im_end|>" and "<|im_start|>" in info["chat_template"]
    assert all(isinstance(v, str) for v in info.get("added_tokens_decoder", {}).values())


def test_invocations_dispatch_by_body(http: httpx.Client) -> None:
    r = http.post("/invocations", json={"messages": USER, "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    r = http.post("/invocations", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["object"] == "text_completion"
    r = http.post("/invocations", json={"input": "hi"})
    assert r.status_code == 400 and "CompletionRequest" in r.json()["error"]["message"]
    r = http.post("/invocations", json={"messages": USER, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    assert http.post("/ping").json()["status"] == "healthy"


def test_endpoint_load_metrics_header(http: httpx.Client) -> None:
    r = chat(http, headers=None)
    assert "endpoint-load-metrics" not in r.headers
    r = http.post(
        "/v1/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"endpoint-load-metrics-format": "text"},
    )
    text = r.headers["endpoint-load-metrics"]
    assert text.startswith("TEXT ") and "named_metrics.kv_cache_usage_perc=" in text
    assert "named_metrics.num_requests_waiting=" in text
    r = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 1},
        headers={"endpoint-load-metrics-format": "json"},
    )
    kind, _, report = r.headers["endpoint-load-metrics"].partition(" ")
    named = json.loads(report)["named_metrics"]
    assert kind == "JSON" and set(named) == {"kv_cache_usage_perc", "num_requests_waiting"}
    assert all(isinstance(v, float) for v in named.values())
    r = http.post(
        "/v1/chat/completions",
        json={"messages": USER, "max_tokens": 1, "stream": True},
        headers={"endpoint-load-metrics-format": "json"},
    )
    assert r.status_code == 200 and "endpoint-load-metrics" not in r.headers


def test_refused_parameters_name_themselves(http: httpx.Client) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": USER}),
        ("/v1/completions", {"prompt": "hi"}),
    ):
        for field, value in (("use_beam_search", True), ("logprob_token_ids", [1, 2])):
            r = http.post(path, json={**body, "max_tokens": 2, "logprobs": True, field: value})
            assert r.status_code == 400, (path, field)
            err = r.json()["error"]
            assert err["param"] == field and field in err["message"]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "use_beam_search": False})
    assert r.status_code == 200
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logit_bias": {"bad1": 5, "bad2": 1}})
    err = r.json()["error"]
    assert (
        r.status_code == 400 and err["param"] == "logit_bias" and "bad1" in err["message"] and "bad2" in err["message"]
    )


def test_truncation_side(http: httpx.Client) -> None:
    prompt = [11, 12, 13, 14, 15, 16]
    kept = {}
    for side in ("left", "right", None):
        r = http.post(
            "/v1/completions",
            json={
                "prompt": prompt,
                "max_tokens": 1,
                "truncate_prompt_tokens": 3,
                "truncation_side": side,
                "return_token_ids": True,
            },
        )
        kept[side] = r.json()["choices"][0]["prompt_token_ids"]
    assert kept == {"left": [14, 15, 16], "right": [11, 12, 13], None: [14, 15, 16]}
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1, "truncation_side": "middle"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncation_side"


def test_minus_one_logprobs_mean_the_whole_vocabulary(http: httpx.Client) -> None:
    """The server runs with --max-logprobs 4096, more than the vocabulary: -1 fits under it (vLLM)."""
    vocab = 2048  # the tiny model's
    r = chat(http, logprobs=True, top_logprobs=-1).json()
    assert [len(t["top_logprobs"]) for t in r["choices"][0]["logprobs"]["content"]] == [vocab, vocab]
    r = http.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1, "prompt_logprobs": -1}).json()
    assert [len(p) if p else None for p in r["choices"][0]["prompt_logprobs"]] == [None, vocab, vocab]
    r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": -1})
    assert r.status_code == 200 and len(r.json()["choices"][0]["logprobs"]["token_logprobs"]) == 1


def test_chat_echo_and_custom_roles(http: httpx.Client) -> None:
    turn = [*USER, {"role": "assistant", "content": "Hello"}]
    args = {"messages": turn, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 2}
    plain = chat(http, **args).json()["choices"][0]["message"]["content"]
    echoed = chat(http, **args, echo=True).json()
    assert echoed["choices"][0]["message"]["content"] == "Hello" + plain
    assert echoed["prompt_logprobs"] is not None  # vLLM: echo asks for the prompt's logprobs
    r = http.post(
        "/v1/chat/completions",
        json={**args, "messages": turn, "temperature": 0, "echo": True, "stream": True},
    )
    deltas = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in deltas if c["choices"])
    assert text == "Hello" + plain
    # the last message is the user's: nothing to echo
    assert (
        chat(http, echo=True).json()["choices"][0]["message"]["content"]
        == chat(http).json()["choices"][0]["message"]["content"]
    )

    custom = [{"role": "narrator", "content": "once"}, *USER]
    assert chat(http, messages=custom).status_code == 200
    # the tiny model's Qwen3 template skips roles it does not know; a plain ChatML one renders them
    plain_chatml = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    ids = http.post("/tokenize", json={"messages": custom, "chat_template": plain_chatml}).json()["tokens"]
    assert "<|im_start|>narrator\nonce" in http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    r = chat(http, messages=[{"role": "", "content": "x"}])
    assert r.status_code == 400 and "role" in r.json()["error"]["param"]


def scrape(http: httpx.Client) -> dict[str, list]:
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f.samples for f in text_string_to_metric_families(http.get("/metrics").text)}


def total(families: dict[str, list], name: str, **labels: str) -> float:
    family = name.removesuffix("_count").removesuffix("_sum").removesuffix("_bucket")
    samples = families.get(family) or families.get(family.removesuffix("_total"), [])
    return sum(s.value for s in samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def test_vllm_metric_families(http: httpx.Client) -> None:
    before = scrape(http)
    phases = ("queue", "prefill", "decode", "inference")
    # a prompt no earlier request shares a block with: one 6-token prefill step, then 2 one-token decode steps
    r = http.post(
        "/v1/completions", json={"prompt": [901, 902, 903, 904, 905, 906], "max_tokens": 3, "ignore_eos": True}
    )
    assert r.status_code == 200
    after = scrape(http)
    grew = {
        name: total(after, name) - total(before, name)
        for name in (
            "vllm:iteration_tokens_total_count",
            "vllm:iteration_tokens_total_sum",
            "vllm:request_params_n_count",
            "vllm:request_params_max_tokens_sum",
            *(f"vllm:request_{p}_time_seconds_count" for p in phases),
        )
    }
    assert grew == {
        "vllm:iteration_tokens_total_count": 3,
        "vllm:iteration_tokens_total_sum": 8,
        "vllm:request_params_n_count": 1,
        "vllm:request_params_max_tokens_sum": 3,
        **{f"vllm:request_{p}_time_seconds_count": 1 for p in phases},
    }
    assert (
        total(after, "vllm:iteration_tokens_total_bucket", le="8.0")
        - total(before, "vllm:iteration_tokens_total_bucket", le="8.0")
        == 3
    )  # 6, 1 and 1 token
    inference = total(after, "vllm:request_inference_time_seconds_sum") - total(
        before, "vllm:request_inference_time_seconds_sum"
    )
    e2e = total(after, "vllm:e2e_request_latency_seconds_sum") - total(before, "vllm:e2e_request_latency_seconds_sum")
    assert 0 < inference <= e2e
    assert {s.labels["reason"] for s in after["vllm:num_requests_waiting_by_reason"]} == {"capacity", "deferred"}
    assert total(after, "vllm:engine_sleep_state", sleep_state="awake") == 1

    headers = {"Authorization": f"Bearer {ADMIN}"}
    assert http.post("/start_weight_update", headers=headers).status_code == 200
    assert http.post("/finish_weight_update", headers=headers, json={}).status_code == 200
    assert http.post("/sleep?level=1", headers=headers).status_code == 200
    asleep = scrape(http)
    assert total(asleep, "vllm:engine_sleep_state", sleep_state="weights_offloaded") == 1
    assert total(asleep, "vllm:engine_sleep_state", sleep_state="awake") == 0
    assert http.post("/wake_up", headers=headers).status_code == 200
    awake = scrape(http)
    assert total(awake, "vllm:engine_sleep_state", sleep_state="awake") == 1
    for name, operation in (
        ("rl_weight_update", "start"),
        ("rl_weight_update", "finish"),
        ("sleep_mode", "sleep"),
        ("sleep_mode", "wake"),
    ):
        assert total(awake, f"vllm:{name}_operation_duration_seconds_count", operation=operation) == 1, operation
        assert total(awake, f"vllm:{name}_operations_in_flight", operation=operation) == 0
