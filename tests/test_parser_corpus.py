"""rlserve's parsers against what vLLM 0.32's own parsers returned (tests/data/parsers, recorded by
scripts/record_vllm_parsers.py): the same calls, content and reasoning, whole and streamed in the
recorded token chunkings. Where rlserve flags a malformed call, the flag replaces vLLM's guess: the
call's raw text must then be in the content and no unflagged call may be lost."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from harmony_vocab import use_harmony_vocab
from rlserve.server.parsers import HARMONY, get_tool_parser
from rlserve.server.parsers.base import Tools
from rlserve.server.parsers.harmony import HarmonyStreamer, parse_harmony
from rlserve.server.parsers.reasoning import ReasoningStreamer, extract_reasoning

DATA = Path(__file__).parent / "data" / "parsers"
# vLLM's answer depends on the tokenizer here, not the text: its mistral parser reads pre-v11 calls
# only with a mistral_common tokenizer (with a Hugging Face one it returns a call named "[").
TOKENIZER_DEPENDENT = {("mistral", "pre_v11")}
# vLLM itself answers these differently streamed (reasoning) and whole (content); streamed runs compare
# with its streamed answer.
VLLM_STREAMS_DIFFERENTLY = {("granite", "unfinished")}


def _harmony_available() -> bool:
    use_harmony_vocab()
    try:
        from rlserve.server.parsers.harmony import _encoding

        _encoding()
        return True
    except Exception:  # noqa: BLE001 - openai-harmony fetches its vocabulary once; this machine has no copy
        return False


def _cases():
    for path in sorted(DATA.glob("*_*.json")):
        data = json.loads(path.read_text())
        for run, cases in data["runs"].items():
            for name, case in cases.items():
                yield pytest.param(data, run, name, case, id=f"{path.stem}-{run}-{name}")


def _norm(x):
    return x or None


def _run(data, run, text, chunks):
    tool = data.get("tool_parser")
    reasoning_name = data.get("reasoning_parser") if run != "tools_only" else None
    tools = data.get("tools")
    if tool == HARMONY or reasoning_name == "openai_gptoss":
        return _run_harmony(text, tools, chunks, with_reasoning=reasoning_name is not None)
    if chunks is None:
        reasoning, content = None, text
        if reasoning_name:
            reasoning, content = extract_reasoning(text, parser=reasoning_name)
        calls, errors = [], []
        if tool and content is not None:
            found = get_tool_parser(tool, tools).extract(content)
            content, calls, errors = found.content, [(c.name, c.arguments) for c in found.tool_calls], found.errors
        return _norm(reasoning), _norm(content), calls, errors
    rs = ReasoningStreamer(parser=reasoning_name) if reasoning_name else None
    ts = get_tool_parser(tool, tools).streamer() if tool else None
    reasoning, content, calls, errors = "", "", {}, []
    for i, piece in enumerate(chunks):
        last = i == len(chunks) - 1
        r, c = rs.feed(piece) if rs else ("", piece)
        if rs and last:
            r2, c2 = rs.finish()
            r, c = r + r2, c + c2
        reasoning += r
        if ts is not None:
            d = ts.feed(c)
            if last:
                d2 = ts.finish()
                d.content += d2.content
                d.tool_calls += d2.tool_calls
                d.errors += d2.errors
            c = d.content
            errors += d.errors
            for tc in d.tool_calls:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name", "") or ""
                entry[1] += tc.get("function", {}).get("arguments", "") or ""
        content += c
    return _norm(reasoning), _norm(content), [tuple(calls[k]) for k in sorted(calls)], errors


def _run_harmony(text, tools, chunks, with_reasoning):
    if chunks is None:
        out = parse_harmony(text, Tools(tools))
        reasoning, content, calls, errors = (
            out.reasoning,
            out.content,
            [(c.name, c.arguments) for c in out.calls],
            out.errors,
        )
    else:
        s = HarmonyStreamer(Tools(tools))
        reasoning, content, calls, errors = "", "", {}, []
        for i, piece in enumerate(chunks):
            r, c, deltas, errs = s.feed(piece, final=i == len(chunks) - 1)
            reasoning, content, errors = reasoning + r, content + c, errors + errs
            for tc in deltas:
                entry = calls.setdefault(tc["index"], ["", ""])
                entry[0] += tc.get("function", {}).get("name", "") or ""
                entry[1] += tc.get("function", {}).get("arguments", "") or ""
        calls = [tuple(calls[k]) for k in sorted(calls)]
    return _norm(reasoning if with_reasoning else None), _norm(content), calls, errors


def _chunkings(text: str) -> dict[str, list[str] | None]:
    out: dict[str, list[str] | None] = {"whole": None, "one_piece": [text], "per_char": list(text)}
    for seed in (11, 23):
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(text[i : i + n])
            i += n
        out[f"random_{seed}"] = pieces
    return out


@pytest.mark.parametrize(("data", "run", "name", "case"), list(_cases()))
def test_matches_vllm(data, run, name, case):
    fmt = data.get("tool_parser") or data.get("reasoning_parser")
    if (fmt, name) in TOKENIZER_DEPENDENT:
        pytest.skip("vLLM's answer here depends on a mistral_common tokenizer")
    if (
        "openai" in (data.get("tool_parser"), "openai" if data.get("reasoning_parser") == "openai_gptoss" else None)
        and not _harmony_available()
    ):
        pytest.skip("openai-harmony's vocabulary file is not on this machine (no download)")
    want = case["whole"]
    if "error" in want:  # vLLM raised (a 500 for its user): rlserve must flag instead
        want = None
    for label, chunks in _chunkings(case["text"]).items():
        reasoning, content, calls, errors = _run(data, run, case["text"], chunks)
        if chunks is not None and (fmt, name) in VLLM_STREAMS_DIFFERENTLY:
            want = case["streamed"]["per_token"]
        where = f"{label}: got reasoning={reasoning!r} content={content!r} calls={calls} errors={errors}"
        if errors or want is None:
            assert errors, where
            for e in errors:
                assert e.text in (content or ""), where
            continue
        assert reasoning == _norm(want["reasoning"]), where
        assert content == _norm(want["content"]), where
        assert calls == [(c["name"], c["arguments"]) for c in want["calls"]], where


def test_registry_and_config_know_every_name():
    import subprocess
    import sys

    from rlserve.config.schema import ModelConfig
    from rlserve.server.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES

    fields = ModelConfig.model_fields
    assert set(fields["tool_call_parser"].annotation.__args__[0].__args__) == set(TOOL_PARSER_NAMES)
    assert set(fields["reasoning_parser"].annotation.__args__[0].__args__) == set(REASONING_PARSER_NAMES)
    assert len(TOOL_PARSER_NAMES) == 21 and len(REASONING_PARSER_NAMES) == 10
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert [n for n in TOOL_PARSER_NAMES + REASONING_PARSER_NAMES if not re.search(rf"\b{n}\b", readme)] == []
    for flag, names in (("tool_call_parser", TOOL_PARSER_NAMES), ("reasoning_parser", REASONING_PARSER_NAMES)):
        refused = subprocess.run(
            [sys.executable, "-m", "rlserve.cli", "serve", f"--model.{flag}", "nope"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert all(f"'{n}'" in refused.stderr + refused.stdout for n in names)
        helped = subprocess.run(
            [sys.executable, "-m", "rlserve.cli", "serve", "--help"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        assert all(n in helped.stdout for n in names)
