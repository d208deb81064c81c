"""The README's and docs/*.md's examples run as written (only the port is changed to the test server's); the
README stays a front door; every "§" the code cites is a heading of docs/protocols.md."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
DEFAULT_URL = "http://127.0.0.1:8000"
README_MAX_BYTES = 8 * 1024


def blocks(lang: str, text: str = README) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def test_first_lines_are_the_two_setup_commands():
    first = blocks("bash")[0].strip().splitlines()
    assert len(first) == 2
    assert "rlserve serve" in first[0] and "pytest" in first[1]
    ci = (ROOT / ".ci" / "run").read_text()
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


@pytest.mark.parametrize("page", [name for name, text in DOCS.items() if blocks("python", text)])
def test_docs_python_examples(server, page):
    for code in blocks("python", DOCS[page]):
        code = code.replace(DEFAULT_URL, server)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, f"docs/{page}:\n{code}\n{out.stderr}"


def test_readme_is_a_front_door():
    size = len(README.encode())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes: move detail into docs/ (limit {README_MAX_BYTES})"
    for link in re.findall(r"\]\((docs/[^)#]+)", README):
        assert (ROOT / link).exists(), f"README links to {link}, which is missing"


def test_docs_links_resolve():
    for name, text in DOCS.items():
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
            assert (ROOT / "docs" / link).resolve().exists(), f"docs/{name} links to {link}, which is missing"


def test_every_protocol_citation_is_a_heading_of_docs_protocols():
    headings = set(re.findall(r"(?m)^#+ (\d+(?:\.\d+)*)\.? ", DOCS["protocols.md"]))
    cited: dict[str, set[str]] = {}
    for path in [*ROOT.glob("src/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("benchmarks/*.py")]:
        for section in re.findall(r"§ ?(\d+(?:\.\d+)*)", path.read_text()):
            cited.setdefault(section, set()).add(str(path.relative_to(ROOT)))
    missing = {s: sorted(files) for s, files in cited.items() if s not in headings}
    assert cited and not missing, f"§ citations without a heading in docs/protocols.md: {missing}"
