"""schemathesis over every route in /openapi.json (public and admin) of a real server: coverage and
fuzzing phases, bounded in examples. No response may be a 5xx, no request may hang, and the server
must still serve afterwards. Findings become rows of test_server_errors.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import httpx
import pytest

from conftest import server_log, start_server, stop_server
from rlserve.runtime.ports import free_port

TESTS = Path(__file__).resolve().parent
EXAMPLES_PER_OPERATION = 3


def _failures_and_summary(stdout: str) -> str:
    """schemathesis prints each failure (with its curl reproduction) under a FAILURES banner, then a
    summary; an assertion message needs both, not only the tail."""
    start = stdout.find("FAILURES")
    failures = stdout[start : start + 6000] if start >= 0 else ""
    return failures + "\n...\n" + "\n".join(stdout.splitlines()[-40:])


def _tracebacks(proc: subprocess.Popen) -> str:
    log = server_log(proc)
    start = log.find("Traceback")
    return log[start : start + 6000] if start >= 0 else log[-3000:]


@pytest.mark.slow
def test_fuzzing_finds_no_server_errors(tmp_path: Path) -> None:
    st = shutil.which("st") or pytest.skip("schemathesis is not installed (pip install -e '.[test]')")
    # a small context and batch keep fuzzed generations short; weights only under an empty root
    url, proc = start_server(
        "--model.max_model_len", "48", "--engine.max_num_seqs", "4", "--weight-roots", f'["{tmp_path}"]'
    )
    try:
        env = {
            **os.environ,
            "SCHEMATHESIS_HOOKS": "fuzz_hooks",
            "RLSERVE_FUZZ_URL": url,
            "RLSERVE_FUZZ_CLOSED_PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        }
        junit = tmp_path / "fuzz.xml"
        run = subprocess.run(
            [
                st,
                "run",
                f"{url}/openapi.json",
                "--phases",
                "coverage,fuzzing",
                "-n",
                str(EXAMPLES_PER_OPERATION),
                "--checks",
                "not_a_server_error",
                "--request-timeout",
                "120",
                "--workers",
                "1",
                "--seed",
                "0",
                "--generation-database",
                "none",
                "--no-color",
                "--report",
                "junit",
                "--report-junit-path",
                str(junit),
            ],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        summary = _failures_and_summary(run.stdout)
        assert run.returncode == 0, f"{summary}\n{run.stderr[-3000:]}\nserver log:\n{_tracebacks(proc)}"
        operations = ET.parse(junit).getroot().iter("testcase")
        assert sum(1 for _ in operations) >= 30  # every route was reached
        print(summary)
        with httpx.Client(base_url=url, timeout=60) as http:
            assert http.get("/health").status_code == 200
            assert http.get("/is_paused").json() == {"is_paused": False}
            r = http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2})
            assert r.status_code == 200, r.text
    finally:
        stop_server(proc)
