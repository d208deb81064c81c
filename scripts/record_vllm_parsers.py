"""Record what vLLM's own tool-call and reasoning parsers return for rlserve's parser corpus.

Run with a Python that has vLLM installed (never rlserve's dependency), from the repository root:

    /work/vv/bin/python scripts/record_vllm_parsers.py

It writes tests/data/parsers/tokenizer.json (rlserve's byte-level test tokenizer plus every
family's markers as single added tokens, no download) and one tests/data/parsers/<format>.json per
format: for each case the model text, the tools, and vLLM's parse of it whole and streamed in
several chunkings (token-aligned, as the engine streams). tests/test_parser_corpus.py replays them
against rlserve's parsers.
"""

from __future__ import annotations

import json
import random
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
OUT = ROOT / "tests" / "data" / "parsers"

FAMILY_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<think>",
    "</think>",
    "<|python_tag|>",
    "<|python_start|>",
    "<|python_end|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "[TOOL_CALLS]",
    "[ARGS]",
    "[CALL_ID]",
    "[THINK]",
    "[/THINK]",
    "<|tool_call|>",
    "<|action_start|>",
    "<|plugin|>",
    "<|action_end|>",
    "<minimax:tool_call>",
    "</minimax:tool_call>",
    "<seed:think>",
    "</seed:think>",
    "<seed:tool_call>",
    "</seed:tool_call>",
    "<seed:bos>",
    "<seed:eos>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
    "<｜end▁of▁sentence｜>",
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Time in a zone",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]


def _j(obj) -> str:
    return json.dumps(obj, ensure_ascii=False)


W = {"city": "Paris", "days": 3}
T = {"tz": "UTC"}


def hermes_call(name, args):
    return f"<tool_call>\n{_j({'name': name, 'arguments': args})}\n</tool_call>"


def xml_call(name, args, open_="<tool_call>", close="</tool_call>"):
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    return f"{open_}\n<function={name}>\n{params}</function>\n{close}"


def glm_call(name, args, sep="\n"):
    params = "".join(f"<arg_key>{k}</arg_key>{sep}<arg_value>{v}</arg_value>{sep}" for k, v in args.items())
    return f"<tool_call>{name}{sep}{params}</tool_call>"


def ds3_calls(calls):
    inner = "".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{_j(a)}\n```<｜tool▁call▁end｜>" for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def ds31_calls(calls):
    inner = "".join(f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{_j(a)}<｜tool▁call▁end｜>" for n, a in calls)
    return f"<｜tool▁calls▁begin｜>{inner}<｜tool▁calls▁end｜>"


def kimi_calls(calls):
    inner = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_j(a)}<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{inner}<|tool_calls_section_end|>"


def minimax_calls(calls):
    inner = "".join(
        f'<invoke name="{n}">\n'
        + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in a.items())
        + "</invoke>\n"
        for n, a in calls
    )
    return f"<minimax:tool_call>\n{inner}</minimax:tool_call>"


def pythonic(calls):
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


def json_list(calls, key="arguments"):
    return _j([{"name": n, key: a} for n, a in calls])


def cut(text: str, frac: float = 0.6) -> str:
    return text[: int(len(text) * frac)]


def corpus_for(fmt: str) -> dict[str, str]:
    """Model outputs per format: name -> text."""
    two = [("get_weather", W), ("get_time", T)]
    if fmt in ("hermes", "qwen3_json"):
        one = hermes_call("get_weather", W)
        return {
            "plain": "The weather is nice.",
            "single": one,
            "content_then_call": "Let me check.\n" + one,
            "two_calls": one + "\n" + hermes_call("get_time", T),
            "cut_mid_call": cut(one),
            "bad_json": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
            "unknown_tool": hermes_call("launch_rocket", {"x": 1}),
            "schema_violation": hermes_call("get_weather", {"days": "three"}),
            "reasoning_then_call": "<think>I should look it up.</think>\n\n" + one,
        }
    if fmt in ("qwen3_coder", "qwen3_xml"):
        one = xml_call("get_weather", W)
        return {
            "plain": "The weather is nice.",
            "single": one,
            "content_then_call": "Let me check.\n" + one,
            "two_calls": one + "\n" + xml_call("get_time", T),
            "cut_mid_call": cut(one),
            "unclosed": one.replace("</tool_call>", ""),
            "unknown_tool": xml_call("launch_rocket", {"x": 1}),
            "reasoning_then_call": "<think>I should look it up.</think>\n\n" + one,
        }
    if fmt in ("glm45", "glm47"):
        sep = "\n" if fmt == "glm45" else ""
        one = glm_call("get_weather", W, sep)
        return {
            "plain": "The weather is nice.",
            "single": one,
            "content_then_call": "Let me check." + sep + one,
            "two_calls": one + sep + glm_call("get_time", T, sep),
            "cut_mid_call": cut(one),
            "unknown_tool": glm_call("launch_rocket", {"x": 1}, sep),
            "reasoning_then_call": "<think>I should look it up.</think>" + one,
        }
    if fmt == "deepseek_v3":
        return {
            "plain": "The weather is nice.",
            "single": ds3_calls([("get_weather", W)]),
            "content_then_call": "Let me check." + ds3_calls([("get_weather", W)]),
            "two_calls": ds3_calls(two),
            "cut_mid_call": cut(ds3_calls([("get_weather", W)])),
            "reasoning_then_call": "I should look it up.</think>" + ds3_calls([("get_weather", W)]),
        }
    if fmt == "deepseek_v31":
        return {
            "plain": "The weather is nice.",
            "single": ds31_calls([("get_weather", W)]),
            "content_then_call": "Let me check." + ds31_calls([("get_weather", W)]),
            "two_calls": ds31_calls(two),
            "cut_mid_call": cut(ds31_calls([("get_weather", W)])),
            "bad_json": ds31_calls([("get_weather", W)]).replace('"Paris"', "Paris"),
            "reasoning_then_call": "I should look it up.</think>" + ds31_calls([("get_weather", W)]),
        }
    if fmt == "kimi_k2":
        return {
            "plain": "The weather is nice.",
            "single": kimi_calls([("get_weather", W)]),
            "content_then_call": "Let me check." + kimi_calls([("get_weather", W)]),
            "two_calls": kimi_calls(two),
            "cut_mid_call": cut(kimi_calls([("get_weather", W)])),
            "reasoning_then_call": "<think>I should look it up.</think>" + kimi_calls([("get_weather", W)]),
        }
    if fmt in ("llama3_json", "llama4_json"):
        one = _j({"name": "get_weather", "parameters": W})
        return {
            "plain": "The weather is nice.",
            "single": one,
            "python_tag": "<|python_tag|>" + one,
            "two_calls": one + "; " + _j({"name": "get_time", "parameters": T}),
            "cut_mid_call": cut(one),
            "bad_json": one.replace('"Paris"', "Paris"),
            "content_then_call": "Sure: " + one,
        }
    if fmt in ("pythonic", "llama4_pythonic"):
        out = {
            "plain": "The weather is nice.",
            "single": pythonic([("get_weather", W)]),
            "two_calls": pythonic(two),
            "cut_mid_call": cut(pythonic([("get_weather", W)])),
            "bad_syntax": "[get_weather(city=)]",
            "content_then_call": "Sure: " + pythonic([("get_weather", W)]),
        }
        if fmt == "llama4_pythonic":
            out["python_start"] = "<|python_start|>" + pythonic([("get_weather", W)]) + "<|python_end|>"
        return out
    if fmt == "mistral":
        return {
            "plain": "The weather is nice.",
            "single": "[TOOL_CALLS]get_weather[ARGS]" + _j(W),
            "content_then_call": "Let me check.[TOOL_CALLS]get_weather[ARGS]" + _j(W),
            "two_calls": "[TOOL_CALLS]get_weather[ARGS]" + _j(W) + "[TOOL_CALLS]get_time[ARGS]" + _j(T),
            "pre_v11": "[TOOL_CALLS]" + json_list(two),
            "cut_mid_call": '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa',
            "reasoning_then_call": "[THINK]I should look it up.[/THINK][TOOL_CALLS]get_weather[ARGS]" + _j(W),
        }
    if fmt == "granite":
        return {
            "plain": "The weather is nice.",
            "single": "<|tool_call|>" + json_list([("get_weather", W)]),
            "two_calls": "<|tool_call|>" + json_list(two),
            "cut_mid_call": cut("<|tool_call|>" + json_list(two)),
            "bad_json": '<|tool_call|>[{"name": "get_weather", "arguments": {city}}]',
            "reasoning_then_call": "Here is my thought process: I should look it up. Here is my response: "
            "<|tool_call|>" + json_list([("get_weather", W)]),
        }
    if fmt == "internlm":
        one = "<|action_start|><|plugin|>\n" + _j({"name": "get_weather", "parameters": W}) + "<|action_end|>"
        return {
            "plain": "The weather is nice.",
            "single": one,
            "content_then_call": "Let me check." + one,
            "cut_mid_call": cut(one),
            "bad_json": one.replace('"Paris"', "Paris"),
        }
    if fmt == "minimax_m2":
        return {
            "plain": "The weather is nice.",
            "single": minimax_calls([("get_weather", W)]),
            "content_then_call": "Let me check.\n" + minimax_calls([("get_weather", W)]),
            "two_calls": minimax_calls(two),
            "cut_mid_call": cut(minimax_calls([("get_weather", W)])),
            "reasoning_then_call": "I should look it up.</think>\n" + minimax_calls([("get_weather", W)]),
        }
    if fmt == "seed_oss":
        one = xml_call("get_weather", W, "<seed:tool_call>", "</seed:tool_call>")
        return {
            "plain": "The weather is nice.",
            "single": one,
            "content_then_call": "Let me check.\n" + one,
            "two_calls": one + "\n" + xml_call("get_time", T, "<seed:tool_call>", "</seed:tool_call>"),
            "cut_mid_call": cut(one),
            "reasoning_then_call": "<seed:think>I should look it up.</seed:think>\n" + one,
        }
    if fmt == "xlam":
        return {
            "plain": "The weather is nice.",
            "single": json_list([("get_weather", W)]),
            "two_calls": json_list(two),
            "fenced": "```json\n" + json_list([("get_weather", W)]) + "\n```",
            "cut_mid_call": cut(json_list(two)),
            "bad_json": '[{"name": "get_weather", "arguments": {city}}]',
            "reasoning_then_call": "<think>I should look it up.</think>" + json_list([("get_weather", W)]),
        }
    if fmt == "phi4_mini_json":
        return {
            "plain": "The weather is nice.",
            "single": "functools" + json_list([("get_weather", W)]),
            "two_calls": "functools" + json_list(two),
            "cut_mid_call": cut("functools" + json_list(two)),
            "bad_json": 'functools[{"name": "get_weather", "arguments": {city}}]',
        }
    if fmt == "openai":
        call = "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        return {
            "plain": "<|channel|>final<|message|>The weather is nice.<|return|>",
            "reasoning_then_final": "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
            "<|channel|>final<|message|>Nice.<|return|>",
            "reasoning_then_call": "<|channel|>analysis<|message|>I should look it up.<|end|>"
            + call
            + _j(W)
            + "<|call|>",
            "single": call.removeprefix("<|start|>assistant") + _j(W) + "<|call|>",
            "cut_mid_call": "<|channel|>analysis<|message|>Hm.<|end|>" + call + '{"city": "Pa',
        }
    raise KeyError(fmt)


# tool format -> the reasoning parser it is served with in the "with reasoning" run (None: tools only)
TOOL_FORMATS = {
    "hermes": "qwen3",
    "qwen3_json": "qwen3",
    "qwen3_coder": "qwen3",
    "qwen3_xml": "qwen3",
    "glm45": "glm45",
    "glm47": "glm45",
    "deepseek_v3": "deepseek_r1",
    "deepseek_v31": "deepseek_r1",
    "kimi_k2": "kimi_k2",
    "llama3_json": None,
    "llama4_json": None,
    "llama4_pythonic": None,
    "pythonic": None,
    "mistral": "mistral",
    "granite": "granite",
    "internlm": None,
    "minimax_m2": "minimax_m2",
    "seed_oss": "seed_oss",
    "xlam": "qwen3",
    "phi4_mini_json": None,
    "openai": "openai_gptoss",
}
REASONING_CORPUS = {
    "complete": "<think>Let me think.\nStep two.</think>\n\nThe answer is 4.",
    "no_start_tag": "Let me think.</think>The answer is 4.",
    "unfinished": "<think>Let me think and think",
    "no_reasoning": "The answer is 4.",
    "empty": "<think></think>Answer.",
}
REASONING_FORMATS = {
    "qwen3": "<think>",
    "deepseek_r1": "<think>",
    "deepseek_v3": "<think>",
    "glm45": "<think>",
    "kimi_k2": "<think>",
    "minimax_m2": "<think>",
    "seed_oss": "<seed:think>",
    "mistral": "[THINK]",
    "granite": None,
    "openai_gptoss": None,
}


def reasoning_corpus(name: str) -> dict[str, str]:
    if name == "granite":
        return {
            "complete": "Here is my thought process: Let me think. Here is my response: The answer is 4.",
            "no_reasoning": "The answer is 4.",
            "unfinished": "Here is my thought process: Let me think",
        }
    if name == "openai_gptoss":
        return {
            "complete": "<|channel|>analysis<|message|>Let me think.<|end|><|start|>assistant<|channel|>final"
            "<|message|>The answer is 4.<|return|>",
            "unfinished": "<|channel|>analysis<|message|>Let me think",
        }
    start = REASONING_FORMATS[name]
    end = {"<think>": "</think>", "<seed:think>": "</seed:think>", "[THINK]": "[/THINK]"}[start]
    return {k: v.replace("<think>", start).replace("</think>", end) for k, v in REASONING_CORPUS.items()}


CHUNKINGS = {"whole": None, "per_token": 1, "random_a": 11, "random_b": 23}


def build_tokenizer_fixture():
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from rlserve.model.make import build_tokenizer

    tok = build_tokenizer()
    have = tok.get_vocab()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in FAMILY_TOKENS if t not in have])
    OUT.mkdir(parents=True, exist_ok=True)
    tok.save(str(OUT / "tokenizer.json"))
    return PreTrainedTokenizerFast(tokenizer_file=str(OUT / "tokenizer.json"), eos_token="<|im_end|>")


def chunk_ids(ids: list[int], how: int | None) -> list[list[int]]:
    if how is None:
        return [ids]
    if how == 1:
        return [[i] for i in ids]
    rng, out, i = random.Random(how), [], 0
    while i < len(ids):
        n = rng.randint(1, 5)
        out.append(ids[i : i + n])
        i += n
    return out


def text_chunks(tok, ids: list[int], how) -> list[tuple[str, list[int]]]:
    """Token-aligned (delta_text, delta_ids); a chunk ending inside a UTF-8 character merges with the next."""
    out, prev_text, pending = [], "", []
    for piece in chunk_ids(ids, how):
        pending += piece
        upto = ids[: sum(len(x) for x in [p for _, p in out]) + len(pending)]
        text = tok.decode(upto, skip_special_tokens=False)
        if text.endswith("\ufffd") and len(upto) < len(ids):
            continue
        out.append((text[len(prev_text) :], pending))
        prev_text, pending = text, []
    return out


def _calls(calls) -> list[dict]:
    return [{"name": c.name, "arguments": c.arguments} for c in calls or []]


def run_case(parser_cls, tok, text: str, tools, ids: list[int], request_kwargs: dict) -> dict:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        tool_choice="auto" if tools else "none",
        **request_kwargs,
    )
    out: dict = {}
    try:
        p = parser_cls(tok, tools)
        reasoning, content, calls = p.parse(text, req, enable_auto_tools=bool(tools), model_output_token_ids=ids)
        out["whole"] = {"reasoning": reasoning, "content": content, "calls": _calls(calls)}
    except Exception as e:  # noqa: BLE001 - recorded: what vLLM does on this input is part of the oracle
        out["whole"] = {"error": f"{type(e).__name__}: {e}"}
    out["streamed"] = {}
    for label, how in CHUNKINGS.items():
        try:
            p = parser_cls(tok, tools)
            chunks = (
                text_chunks(tok, ids, how) if not _is_harmony(parser_cls) else [("", c) for c in chunk_ids(ids, how)]
            )
            reasoning, content, calls = "", "", {}
            for n, (delta_text, delta_ids) in enumerate(chunks):
                d = p.parse_delta(delta_text, list(delta_ids), req, prompt_token_ids=[1], finished=n == len(chunks) - 1)
                if d is None:
                    continue
                reasoning += d.reasoning or ""
                content += d.content or ""
                for tc in d.tool_calls or []:
                    c = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                    if tc.function is not None:
                        c["name"] += tc.function.name or ""
                        c["arguments"] += tc.function.arguments or ""
            out["streamed"][label] = {
                "reasoning": reasoning or None,
                "content": content or None,
                "calls": [calls[k] for k in sorted(calls)],
            }
        except Exception as e:  # noqa: BLE001 - recorded as vLLM's answer
            out["streamed"][label] = {"error": f"{type(e).__name__}: {e}"}
    return out


def _is_harmony(parser_cls) -> bool:
    return parser_cls.__name__ == "HarmonyParser"


def encode(tok, text: str, harmony: bool) -> list[int]:
    if harmony:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS).encode(text, allowed_special="all")
    return tok.encode(text, add_special_tokens=False)


def record(tok, tool: str | None, reasoning: str | None, corpus: dict[str, str], tools) -> dict:
    from vllm.parser.parser_manager import ParserManager

    harmony = tool == "openai" or reasoning == "openai_gptoss"
    parser_cls = ParserManager.get_parser(
        tool_parser_name=tool, reasoning_parser_name=reasoning, enable_auto_tools=tools is not None, is_harmony=harmony
    )
    cases = {}
    for name, text in corpus.items():
        ids = encode(tok, text, harmony)
        cases[name] = {"text": text, **run_case(parser_cls, tok, text, tools, ids, {})}
    return cases


def write_harmony_vocab() -> None:
    """gpt-oss's o200k vocabulary in tiktoken's file format, read back from the Harmony encoding vLLM uses
    (openai-harmony checks its sha256 when it loads it), so the tests need no download."""
    import base64
    import gzip

    from openai_harmony import HarmonyEncodingName, load_harmony_encoding

    enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    lines = [f"{base64.b64encode(bytes(enc._inner.decode_bytes([i]))).decode()} {i}\n" for i in range(199998)]
    (OUT / "o200k_base.tiktoken.gz").write_bytes(gzip.compress("".join(lines).encode(), 9, mtime=0))


def main() -> None:
    tok = build_tokenizer_fixture()
    write_harmony_vocab()
    only = set(sys.argv[1:])
    for fmt, paired in TOOL_FORMATS.items():
        if only and fmt not in only:
            continue
        try:
            data = {
                "tool_parser": fmt,
                "tools": TOOLS,
                "runs": {"tools_only": record(tok, fmt, None, corpus_for(fmt), TOOLS)},
            }
            if paired is not None:
                data["reasoning_parser"] = paired
                data["runs"]["with_reasoning"] = record(tok, fmt, paired, corpus_for(fmt), TOOLS)
        except Exception:  # noqa: BLE001 - reported, the other formats still record
            traceback.print_exc()
            continue
        (OUT / f"tool_{fmt}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print("recorded tool parser", fmt)
    for name in REASONING_FORMATS:
        if only and name not in only:
            continue
        try:
            data = {
                "reasoning_parser": name,
                "runs": {"reasoning_only": record(tok, None, name, reasoning_corpus(name), None)},
            }
        except Exception:  # noqa: BLE001 - reported, the other formats still record
            traceback.print_exc()
            continue
        (OUT / f"reasoning_{name}.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
        print("recorded reasoning parser", name)


if __name__ == "__main__":
    main()
