"""The parsers end to end: a server forced (vllm_xargs.forced_token_ids) to emit each recorded case's exact
text answers as vLLM's parsers did, streamed and not, with the family's chat template (a fixture written
from its published format); malformed calls come back 200 with `tool_call_errors` and untouched token
ids; a Qwen3-Coder and a gpt-oss agent loop of three tool turns through the openai SDK, on chat
completions and on the Responses API."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import start_server, stop_server
from harmony_vocab import use_harmony_vocab
from rlserve.model.make import default_model_dir

DATA = Path(__file__).parent / "data" / "parsers"
FAMILIES = {  # tool parser -> (reasoning parser, chat template fixture)
    "qwen3_coder": ("qwen3", "qwen3_coder.jinja"),
    "openai": ("openai_gptoss", "gpt_oss.jinja"),
}
MODEL = "rlserve-default"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request) -> Iterator[tuple[str, str]]:
    use_harmony_vocab()
    reasoning, template = FAMILIES[request.param]
    url, proc = start_server(
        "--engine.allow-forced-tokens",
        "--model.tool_call_parser",
        request.param,
        "--model.reasoning_parser",
        reasoning,
        "--model.chat_template",
        str(DATA / "templates" / template),
        "--model.max_model_len",
        "2048",
    )  # three tool turns of byte-level text
    try:
        yield request.param, url
    finally:
        stop_server(proc)


def _forced(tok, text: str) -> list[int]:
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text
    return ids + [tok.convert_tokens_to_ids("<|im_end|>")]


def _chat(url: str, messages, tools, forced, stream: bool, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": messages,
        "tools": tools,
        "max_tokens": len(forced) + 4,
        "return_token_ids": True,
        "vllm_xargs": {"forced_token_ids": forced},
        "stream": stream,
        **extra,
    }
    if not stream:
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        m = choice["message"]
        return {
            "reasoning": m.get("reasoning"),
            "content": m["content"],
            "token_ids": choice["token_ids"],
            "calls": [(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []],
            "errors": choice.get("tool_call_errors") or [],
            "finish_reason": choice["finish_reason"],
        }
    out = {"reasoning": "", "content": "", "token_ids": [], "calls": {}, "errors": [], "finish_reason": None}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                d = choice["delta"]
                out["reasoning"] += d.get("reasoning") or ""
                out["content"] += d.get("content") or ""
                out["token_ids"] += choice.get("token_ids") or []
                out["errors"] += choice.get("tool_call_errors") or []
                out["finish_reason"] = choice.get("finish_reason") or out["finish_reason"]
                for tc in d.get("tool_calls") or []:
                    entry = out["calls"].setdefault(tc["index"], ["", ""])
                    entry[0] += tc.get("function", {}).get("name") or ""
                    entry[1] += tc.get("function", {}).get("arguments") or ""
    out["calls"] = [tuple(out["calls"][k]) for k in sorted(out["calls"])]
    out["reasoning"], out["content"] = out["reasoning"] or None, out["content"] or None
    return out


def test_recorded_cases_over_http(family, tok) -> None:
    name, url = family
    data = json.loads((DATA / f"tool_{name}.json").read_text())
    for case_name, case in data["runs"]["with_reasoning"].items():
        want = case["whole"]
        forced = _forced(tok, case["text"])
        for stream in (False, True):
            got = _chat(url, [{"role": "user", "content": "weather?"}], data["tools"], forced, stream)
            where = f"{case_name} stream={stream}: {got}"
            assert got["token_ids"] == forced, where
            if got["errors"]:
                assert all(e["text"] in (got["content"] or "") for e in got["errors"]), where
                assert {e["type"] for e in got["errors"]} <= {
                    "invalid_json",
                    "unknown_tool",
                    "unclosed_call",
                    "schema_mismatch",
                    "invalid_syntax",
                }, where
                continue
            assert got["reasoning"] == (want["reasoning"] or None), where
            assert got["content"] == (want["content"] or None), where
            assert got["calls"] == [(c["name"], c["arguments"]) for c in want["calls"]], where
            assert got["finish_reason"] == ("tool_calls" if want["calls"] else "stop"), where


def test_malformed_call_is_flagged_not_dropped(family, tok) -> None:
    name, url = family
    data = json.loads((DATA / f"tool_{name}.json").read_text())
    text = data["runs"]["tools_only"]["cut_mid_call"]["text"]
    forced = _forced(tok, text)
    for stream in (False, True):
        got = _chat(url, [{"role": "user", "content": "weather?"}], data["tools"], forced, stream)
        assert got["calls"] == [] and got["token_ids"] == forced
        assert [e["type"] for e in got["errors"]] == ["unclosed_call"]
        assert got["errors"][0]["text"] in got["content"]
    r = httpx.post(
        f"{url}/v1/responses",
        timeout=120,
        json={
            "model": MODEL,
            "input": "weather?",
            "max_output_tokens": len(forced) + 4,
            "tools": [{"type": "function", **t["function"]} for t in data["tools"]],
            "vllm_xargs": {"forced_token_ids": forced},
        },
    )
    assert r.status_code == 200 and [e["type"] for e in r.json()["tool_call_errors"]] == ["unclosed_call"]


def test_tool_choice_modes(family, tok) -> None:
    name, url = family
    tools = json.loads((DATA / f"tool_{name}.json").read_text())["tools"]
    forced = _forced(tok, TURN_TEXTS[name](*STEPS[0]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        for stream in (False, True):
            got = _chat(url, [{"role": "user", "content": "weather?"}], tools, forced, stream, tool_choice=choice)
            assert got["calls"] == [("get_weather", json.dumps(STEPS[0][1]))], (choice, stream, got)
            assert got["finish_reason"] == "tool_calls"
    for stream in (False, True):  # none: the tools are rendered, nothing is parsed as a call
        got = _chat(url, [{"role": "user", "content": "weather?"}], tools, forced, stream, tool_choice="none")
        assert got["calls"] == [] and got["finish_reason"] == "stop" and "Paris" in (got["content"] or ""), got


TURN_TEXTS = {
    "qwen3_coder": lambda n, a: (
        f"<think>need {n}</think>\n\n<tool_call>\n<function={n}>\n"
        + "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in a.items())
        + "</function>\n</tool_call>"
    ),
    "openai": lambda n, a: (
        f"<|channel|>analysis<|message|>need {n}<|end|><|start|>assistant<|channel|>commentary "
        f"to=functions.{n} <|constrain|>json<|message|>{json.dumps(a)}<|call|>"
    ),
}
FINAL_TEXTS = {
    "qwen3_coder": "<think>done</think>\n\nParis: sunny, 12:00 UTC.",
    "openai": "<|channel|>final<|message|>Paris: sunny, 12:00 UTC.<|return|>",
}
STEPS = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {"tz": "UTC"})]


def test_agent_loop_chat_sdk(family, tok) -> None:
    name, url = family
    tools = json.loads((DATA / f"tool_{name}.json").read_text())["tools"]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    messages: list = [{"role": "user", "content": "Weather and time in Paris?"}]
    for turn in range(3):
        text = TURN_TEXTS[name](*STEPS[turn]) if turn < 2 else FINAL_TEXTS[name]
        forced = _forced(tok, text)
        r = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            max_tokens=len(forced) + 4,
            extra_body={"vllm_xargs": {"forced_token_ids": forced}},
        )
        msg = r.choices[0].message
        if turn == 2:
            # vLLM's qwen3 keeps the newlines after </think> in the content
            assert r.choices[0].finish_reason == "stop" and msg.content.strip() == "Paris: sunny, 12:00 UTC."
            break
        assert r.choices[0].finish_reason == "tool_calls", (turn, r.usage, msg)
        (call,) = msg.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == STEPS[turn]
        messages.append(msg.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}"})


def test_agent_loop_responses_api(family, tok) -> None:
    name, url = family
    tools = [
        {"type": "function", **t["function"]} for t in json.loads((DATA / f"tool_{name}.json").read_text())["tools"]
    ]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    items: list = [{"role": "user", "content": "Weather and time in Paris?"}]
    for turn in range(3):
        text = TURN_TEXTS[name](*STEPS[turn]) if turn < 2 else FINAL_TEXTS[name]
        forced = _forced(tok, text)
        r = client.responses.create(
            model=MODEL,
            input=items,
            tools=tools,
            max_output_tokens=len(forced) + 4,
            extra_body={"vllm_xargs": {"forced_token_ids": forced}},
        )
        assert r.status == "completed"
        calls = [o for o in r.output if o.type == "function_call"]
        if turn == 2:
            assert calls == [] and r.output_text.strip() == "Paris: sunny, 12:00 UTC."
            break
        (call,) = calls
        assert (call.name, json.loads(call.arguments)) == STEPS[turn]
        items += [o.model_dump(exclude_none=True) for o in r.output]
        items.append({"type": "function_call_output", "call_id": call.call_id, "output": f"result {turn}"})
