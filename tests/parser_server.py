"""One server with the tool and reasoning parsers and forced tokens on, shared by the tool-calling
and Responses tests (fixtures imported by both modules)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from conftest import start_server, stop_server
from rlserve.model.make import default_model_dir


@pytest.fixture(scope="session")
def base_url() -> Iterator[str]:
    url, proc = start_server(
        "--engine.allow-forced-tokens", "--model.tool_call_parser", "hermes", "--model.reasoning_parser", "qwen3"
    )
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def tok():
    return AutoTokenizer.from_pretrained(default_model_dir())
