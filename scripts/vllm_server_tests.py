"""Run vLLM 0.32's own HTTP-level server tests against rlserve.

Fetches the vllm 0.32.0 sdist from PyPI at run time (never copied into this repo), takes its
tests/entrypoints/{openai,serve,anthropic}/, and runs them with a shim: `tests/utils.py` and
`tests/conftest.py` are replaced by ones whose `RemoteOpenAIServer` starts `rlserve serve` on a model that
`rlserve make-model` writes (the vLLM launch flags the tests pass go through rlserve's vLLM dialect), so every
request a test sends goes to rlserve. Each test file runs in its own pytest process under a time limit.

    python scripts/vllm_server_tests.py [--vllm-site DIR] [--only PATTERN ...] [--timeout-per-file 300]

Needs pytest and the test deps the files import; pytest-asyncio, pytest-timeout and tblib are installed into the
work directory when missing. `--vllm-site` appends a vLLM installation's site-packages to the tests' import
path so files that import vLLM helpers (its tokenizer loader, protocol classes) can run; without it those
files fail at import and are counted as errors. The server under test is rlserve either way.

`pip download vllm==0.32.0 --no-deps --no-binary :all:` cannot be used: pip prepares the sdist's metadata,
which builds vLLM's build dependencies from source. The file is fetched from the PyPI simple index instead
and checked against the index's sha256.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from pathlib import Path

VERSION = "0.32.0"
INDEX = "https://pypi.org/simple/vllm/"
REPO = Path(__file__).resolve().parents[1]
TEST_DIRS = ("tests/entrypoints/openai/", "tests/entrypoints/serve/", "tests/entrypoints/anthropic/")
KEEP = ("tests/__init__.py", "tests/conftest.py", "tests/entrypoints/__init__.py", "tests/entrypoints/conftest.py")
KEEP += (
    "tests/ci_envs.py",
    "tests/models/__init__.py",
    "tests/models/utils.py",
    "tests/models/registry.py",
    "examples/",
)
SHIM = Path(__file__).resolve().parent / "vllm_shim"


def fetch_sdist(into: Path) -> Path:
    path = into / f"vllm-{VERSION}.tar.gz"
    if path.exists():
        return path
    request = urllib.request.Request(INDEX, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        files = json.load(r)["files"]
    (entry,) = [f for f in files if f["filename"] == path.name]
    print(f"fetching {entry['url']}", flush=True)
    with urllib.request.urlopen(entry["url"], timeout=600) as r:
        data = r.read()
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise SystemExit(f"{path.name}: sha256 differs from the index")
    path.write_bytes(data)
    return path


def extract(sdist: Path, into: Path) -> Path:
    root = into / f"vllm-{VERSION}"
    if not root.exists():
        _unpack(sdist, into, root)
    for name in ("conftest.py", "utils.py"):  # every run: the shim of this checkout
        (root / "tests" / name).write_text((SHIM / name).read_text())
    return root


def _unpack(sdist: Path, into: Path, root: Path) -> None:
    prefix = f"vllm-{VERSION}/"
    with tarfile.open(sdist) as tar:
        members = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix) and m.name[len(prefix) :].startswith((*TEST_DIRS, *KEEP)) and m.isfile()
        ]
        tar.extractall(into, members=members, filter="data")
    # the shim's, not vLLM's (they import all of vLLM); names a test takes from vLLM's conftest come from it lazily
    (root / "tests" / "conftest.py").rename(root / "tests" / "vllm_conftest.py")


def ensure_deps(work: Path) -> Path:
    deps = work / "deps"
    wanted = {"pytest_asyncio": "pytest-asyncio", "pytest_timeout": "pytest-timeout", "tblib": "tblib"}
    missing = [pkg for module, pkg in wanted.items() if not _importable(module) and not list(deps.glob(f"{module}*"))]
    if missing:
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), *missing]
        subprocess.run(cmd, check=True)
    return deps


def _importable(module: str) -> bool:
    return subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True).returncode == 0


def make_model(work: Path, env: dict[str, str]) -> Path:
    out = work / "model"
    if not out.exists():
        cmd = [sys.executable, "-m", "rlserve.cli", "make-model", "--preset", "tiny", "--out", str(out)]
        subprocess.run(cmd, check=True, env=env)
    return out


def run_file(root: Path, test: Path, env: dict[str, str], limit: int, per_test: int, reports: Path) -> dict:
    rel = test.relative_to(root)
    xml = reports / (str(rel).replace("/", "__") + ".xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "asyncio_mode=auto"]
    cmd += ["--timeout", str(per_test), f"--junitxml={xml}", str(rel)]
    started = time.monotonic()
    # its own process group, which the servers it starts join: a file over its limit goes down whole
    proc = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        tail = proc.communicate(timeout=limit)[0][-3000:]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return {"file": str(rel), "timed_out": True, "seconds": round(time.monotonic() - started)}
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # a server a test left behind
    result = {"file": str(rel), "seconds": round(time.monotonic() - started), **junit_counts(xml)}
    if not xml.exists():
        result["errors"], result["reasons"] = 1, {"(collection)": tail.strip().splitlines()[-1:]}
    return result


def junit_counts(xml: Path) -> dict:
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "reasons": {}}
    if not xml.exists():
        return counts
    for case in ET.parse(xml).getroot().iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "errors", "skipped": "skipped"}[child.tag]
                if outcome != "skipped":
                    message = (child.get("message") or child.text or "").strip().splitlines()
                    counts["reasons"][case.get("name")] = message[0][:300] if message else ""
        counts[outcome] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "rlserve-vllm-tests")
    parser.add_argument("--vllm-site", help="site-packages of a vLLM install, for the files' vLLM imports")
    parser.add_argument("--only", nargs="*", default=[], help="run only test files whose path contains one of these")
    parser.add_argument("--skip", nargs="*", default=[], help="skip test files whose path contains one of these")
    parser.add_argument("--first", nargs="*", default=[], help="run files whose path contains one of these first")
    parser.add_argument("--all", action="store_true", help="also files that start no server (vLLM unit tests)")
    parser.add_argument("--timeout-per-file", type=int, default=900, help="seconds; the file's results are lost")
    parser.add_argument("--timeout-per-test", type=int, default=120, help="seconds; the test fails with Timeout")
    parser.add_argument("--out", type=Path, help="write the per-file results here as JSON")
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    root = extract(fetch_sdist(args.work), args.work)
    deps = ensure_deps(args.work)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(deps), str(REPO / "src"), str(root)])}
    env.pop("VLLM_API_KEY", None)
    model = make_model(args.work, env)
    env |= {"RLSERVE_SHIM_MODEL": str(model), "RLSERVE_SHIM_VLLM_SITE": args.vllm_site or "", "VLLM_PATH": str(root)}
    reports = args.work / "reports"
    reports.mkdir(exist_ok=True)
    tests = sorted(p for d in TEST_DIRS for p in (root / d).rglob("test_*.py"))
    tests = [t for t in tests if not args.only or any(s in str(t) for s in args.only)]
    tests = [t for t in tests if not any(s in str(t) for s in args.skip)]
    if not args.all:  # the others test vLLM's own classes in-process, not a server
        tests = [t for t in tests if "RemoteOpenAIServer" in t.read_text()]
    first = [t for t in tests if any(s in str(t) for s in args.first)]
    tests = first + [t for t in tests if t not in first]
    results = []
    for test in tests:
        result = run_file(root, test, env, args.timeout_per_file, args.timeout_per_test, reports)
        results.append(result)
        print(json.dumps({k: v for k, v in result.items() if k != "reasons"}), flush=True)
        if args.out:
            args.out.write_text(json.dumps(results, indent=1))
    print_table(results)


def print_table(results: list[dict]) -> None:
    print("\n| file | passed | failed | errors | skipped |\n|---|---|---|---|---|")
    for r in results:
        if r.get("timed_out"):
            print(f"| {r['file']} | timed out after {r['seconds']} s | | | |")
        else:
            print(f"| {r['file']} | {r['passed']} | {r['failed']} | {r['errors']} | {r['skipped']} |")


if __name__ == "__main__":
    main()
