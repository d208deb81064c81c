"""The README's examples run as written (only the port is changed to the test server's)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
DEFAULT_URL = "http://127.0.0.1:8000"


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_first_lines_are_the_two_setup_commands():
    first = blocks("bash")[0].strip().splitlines()
    assert len(first) == 2
    assert "rlserve serve" in first[0] and "pytest" in first[1]
    ci = (Path(__file__).resolve().parents[1] / ".ci" / "run").read_text()
    assert first[1].split("#")[0].strip() in ci


def test_curl_example(server):
    curl = next(b for b in blocks("bash") if "curl" in b)
    command = curl[curl.index("curl") :].replace(DEFAULT_URL, server)
    out = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60, check=True)
    body = json.loads(out.stdout)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == 8 and len(choice["logprobs"]["token_logprobs"]) == 8


def test_python_examples(server):
    for code in blocks("python"):
        code = code.replace(DEFAULT_URL, server)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
