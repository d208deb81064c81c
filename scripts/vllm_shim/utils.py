"""Stands in for vLLM's tests/utils.py: `RemoteOpenAIServer` starts `rlserve serve` instead of `vllm serve`,
with the same client helpers. The model name a test asks for becomes the served name of a model that
`rlserve make-model` wrote (RLSERVE_SHIM_MODEL); its vLLM launch flags go through rlserve's vLLM dialect,
except those listed in DROPPED (GPU memory and loading knobs with no meaning on this model) and `--runner pooling`
(the stand-in model generates)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

VLLM_PATH = Path(os.environ.get("VLLM_PATH", "."))
ROCM_EXTRA_ARGS: list[str] = []
MAX_MODEL_LEN = 4096  # the make-model tiny preset's positions
# flag -> whether it takes a value
DROPPED = {
    "--hf-overrides": True,
    "--load-format": True,
    "--tokenizer": True,
    "--distributed-executor-backend": True,
    "--attention-backend": True,
    "--no-async-scheduling": False,
    "--enable-chunked-prefill": False,
    "--disable-frontend-multiprocessing": False,
    "--limit-mm-per-prompt": True,  # the files that pass it test a vision model; rlserve refuses it (text only)
}


def multi_gpu_only(*args, **kwargs):
    return pytest.mark.skip(reason="needs several GPUs")


def requires_fp8(*args, **kwargs):
    return pytest.mark.skip(reason="needs fp8")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def translate(model: str, args: list[str], seed: int | None) -> tuple[list[str], str, int]:
    out, host, port, i = [], "127.0.0.1", None, 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        name = name.replace("_", "-") if name.startswith("--") else name  # vLLM reads --max_model_len too
        value = inline if eq else (args[i + 1] if i + 1 < len(args) else None)
        step = 1 if eq else 2
        if name in DROPPED:
            i += step if DROPPED[name] else 1
            continue
        if name in ("--port", "-p"):
            port = int(value)
        elif name == "--host":
            host = value
        elif name == "--dtype":
            out += ["--dtype", "float32"]  # the tests ask half precision to save GPU memory; CPU runs fp32
        elif name == "--runner" and value == "pooling":
            pass  # an embedding model's tests (middleware, headers) run on the generative stand-in; rlserve refuses it
        elif name == "--max-model-len":
            out += ["--max-model-len", str(min(int(value), MAX_MODEL_LEN))]
        else:
            out.append(arg)
            i += 1
            continue
        i += step
    if "--served-model-name" not in out:
        out += ["--served-model-name", model]
    if seed is not None and "--seed" not in out:
        out += ["--seed", str(seed)]
    return out, host, port or _free_port()


class RemoteOpenAIServer:
    DUMMY_API_KEY = "token-abc123"

    def __init__(
        self,
        model: str,
        vllm_serve_args: list[str],
        *,
        env_dict: dict[str, str] | None = None,
        seed: int | None = 0,
        auto_port: bool = True,
        max_wait_seconds: float | None = None,
        override_hf_configs: dict | None = None,
    ) -> None:
        args, self.host, self.port = translate(model, list(vllm_serve_args), seed)
        self.uds = None
        env = {**os.environ, **(env_dict or {})}
        cmd = [sys.executable, "-m", "rlserve.cli", "serve", os.environ["RLSERVE_SHIM_MODEL"], *args]
        cmd += ["--host", self.host, "--port", str(self.port)]
        self.log = Path(tempfile.mkstemp(prefix="rlserve-shim-", suffix=".log")[1])
        print("starting rlserve:", " ".join(cmd), flush=True)
        with self.log.open("wb") as log:
            # in pytest's process group: the runner stops the group when a file runs over its limit
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + (max_wait_seconds or 300)
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"rlserve exited ({self.proc.returncode}): {self.log.read_text()[-1500:]}")
            try:
                if httpx.get(self.url_for("health"), timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self._stop()
                raise RuntimeError("rlserve failed to start in time")
            time.sleep(0.3)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._stop()

    def _stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.unlink(missing_ok=True)

    @property
    def url_root(self) -> str:
        return f"http://{self.host}:{self.port}"

    def url_for(self, *parts: str) -> str:
        path = "/".join(part.strip("/") for part in parts if part)
        return f"{self.url_root}/{path}"

    def get_client(self, **kwargs):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.OpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client(self, **kwargs):
        import openai

        kwargs.setdefault("timeout", 600)
        return openai.AsyncOpenAI(base_url=self.url_for("v1"), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_client_anthropic(self, **kwargs):
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.Anthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)

    def get_async_client_anthropic(self, **kwargs):
        import anthropic

        kwargs.setdefault("timeout", 600)
        return anthropic.AsyncAnthropic(base_url=self.url_for(), api_key=self.DUMMY_API_KEY, max_retries=0, **kwargs)


RemoteVLLMServer = RemoteOpenAIServer
