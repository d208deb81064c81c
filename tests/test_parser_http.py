"""The parsers end to end: a server forced (vllm_xargs.forced_token_ids) to emit each recorded case's exact
text answers as vLLM's parsers did, streamed and not, for every tool-call family with its chat template (a
fixture written from the family's published format); malformed calls come back 200 with `tool_call_errors`
and untouched token ids; a Qwen3-Coder and a gpt-oss agent loop of three tool turns through the openai SDK,
on chat completions and on the Responses API. One server per family, shared by that family's tests."""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import server_log, start_server, stop_server
from harmony_vocab import use_harmony_vocab
from rlserve.model.make import default_model_dir
from rlserve.server.parsers import TOOL_PARSER_NAMES

DATA = Path(__file__).parent / "data" / "parsers"
TEMPLATES = {  # tool parser -> chat template fixture (tests/data/parsers/templates)
    "hermes": "qwen3.jinja",
    "qwen3_json": "qwen3.jinja",
    "qwen3_coder": "qwen3_coder.jinja",
    "qwen3_xml": "qwen3_coder.jinja",
    "glm45": "glm45.jinja",
    "glm47": "glm47.jinja",
    "deepseek_v3": "deepseek_v3.jinja",
    "deepseek_v31": "deepseek_v31.jinja",
    "kimi_k2": "kimi_k2.jinja",
    "openai": "gpt_oss.jinja",
    "llama3_json": "llama3_json.jinja",
    "llama4_json": "llama4_json.jinja",
    "llama4_pythonic": "llama4_pythonic.jinja",
    "pythonic": "pythonic.jinja",
    "mistral": "mistral.jinja",
    "granite": "granite.jinja",
    "internlm": "internlm.jinja",
    "minimax_m2": "minimax_m2.jinja",
    "seed_oss": "seed_oss.jinja",
    "xlam": "xlam.jinja",
    "phi4_mini_json": "phi4_mini.jinja",
}
AGENT_FAMILIES = ["qwen3_coder", "openai"]
# vLLM's answer here depends on a mistral_common tokenizer, not the text (tests/test_parser_corpus.py)
TOKENIZER_DEPENDENT = {("mistral", "pre_v11")}
MODEL = "rlserve-default"
USER = [{"role": "user", "content": "weather?"}]


def _recorded(name: str) -> tuple[dict, dict]:
    """(the family's recorded data, the run the server answers: with its reasoning parser when recorded)."""
    data = json.loads((DATA / f"tool_{name}.json").read_text())
    return data, data["runs"].get("with_reasoning", data["runs"]["tools_only"])


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def family(request) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """(tool parser, base url, server process) for the family the test names (indirect parameter)."""
    use_harmony_vocab()
    name = request.param
    data, _ = _recorded(name)
    reasoning = ("--model.reasoning_parser", data["reasoning_parser"]) if "with_reasoning" in data["runs"] else ()
    # the parsers run in the HTTP process either way: the other families save a process start in the engine thread
    in_thread = () if name in AGENT_FAMILIES else ("--engine.core_process", "false")
    url, proc = start_server(
        *in_thread,
        "--engine.allow-forced-tokens",
        "--model.tool_call_parser",
        name,
        *reasoning,
        "--model.chat_template",
        str(DATA / "templates" / TEMPLATES[name]),
        "--model.max_model_len",
        "2048",
    )  # three tool turns of byte-level text
    try:
        yield name, url, proc
    finally:
        stop_server(proc)


def with_server_log(test):
    """A failing test prints its server's log (an engine that died says why there)."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        try:
            return test(*args, **kwargs)
        except BaseException:
            print(f"--- log of the {kwargs['family'][0]} server ---\n{server_log(kwargs['family'][2])}")
            raise

    return run


def test_every_family_is_served_over_http() -> None:
    assert sorted(TEMPLATES) == sorted(TOOL_PARSER_NAMES)


def test_openai_parser_without_the_vocabulary_refuses_to_start(tmp_path) -> None:
    env = {**os.environ, "TIKTOKEN_ENCODINGS_BASE": str(tmp_path)}  # a folder without o200k_base.tiktoken
    refused = subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "serve", "--server.port", "0", "--model.tool_call_parser", "openai"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert refused.returncode != 0 and "TIKTOKEN_ENCODINGS_BASE" in refused.stderr, refused.stderr[-2000:]


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
            "prompt_token_ids": r.json()["prompt_token_ids"],
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


# the agent families first: pytest then runs each family's tests together, on one server
@pytest.mark.parametrize("family", AGENT_FAMILIES + [n for n in TEMPLATES if n not in AGENT_FAMILIES], indirect=True)
@with_server_log
def test_recorded_cases_over_http(family, tok) -> None:
    name, url, _ = family
    data, run = _recorded(name)
    template = (DATA / "templates" / TEMPLATES[name]).read_text()
    prompt = tok.apply_chat_template(
        USER, tools=data["tools"], chat_template=template, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    for case_name, case in run.items():
        if (name, case_name) in TOKENIZER_DEPENDENT:
            continue
        want = case["whole"]
        forced = _forced(tok, case["text"])
        for stream in (False, True):
            got = _chat(url, USER, data["tools"], forced, stream)
            where = f"{case_name} stream={stream}: {got}"
            assert got["token_ids"] == forced, where
            if not stream:  # the family's template made the prompt
                assert got["prompt_token_ids"] == prompt, where
            if got["errors"] or "error" in want:  # vLLM raised here: rlserve flags instead
                assert got["errors"], where
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


@pytest.mark.parametrize("family", AGENT_FAMILIES, indirect=True)
@with_server_log
def test_malformed_call_is_flagged_not_dropped(family, tok) -> None:
    name, url, _ = family
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


@pytest.mark.parametrize("family", AGENT_FAMILIES, indirect=True)
@with_server_log
def test_tool_choice_modes(family, tok) -> None:
    name, url, _ = family
    tools = json.loads((DATA / f"tool_{name}.json").read_text())["tools"]
    forced = _forced(tok, TURN_TEXTS[name](*STEPS[0]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("auto", "required", named):
        for stream in (False, True):
            got = _chat(url, [{"role": "user", "content": "weather?"}], tools, forced, stream, tool_choice=choice)
            assert got["calls"] == [("get_weather", json.dumps(STEPS[0][1]))], (choice, stream, got)
            assert got["finish_reason"] == ("stop" if choice is named else "tool_calls"), (choice, stream)
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


@pytest.mark.parametrize("family", AGENT_FAMILIES, indirect=True)
@with_server_log
def test_agent_loop_chat_sdk(family, tok) -> None:
    name, url, _ = family
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


@pytest.mark.parametrize("family", AGENT_FAMILIES, indirect=True)
@with_server_log
def test_agent_loop_responses_api(family, tok) -> None:
    name, url, _ = family
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
