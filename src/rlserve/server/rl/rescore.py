"""POST /v1/rescore: a fail-closed check that a finished sequence's logprobs are reproducible.

The caller sends what generation returned (prompt ids, completion ids, their logprobs and the
policy version that produced them). The server scores the whole sequence again as one prompt and
reports every completion token whose logprob differs. The comparison is against the raw
distribution (log_softmax of the logits: temperature 1, no filters), which is what generation
returns with `logprobs_mode=raw`, or with temperature 1 and no top-k/top-p/min-p.

Under `engine.batch_invariant` the re-score must equal generation bit for bit, so any difference
answers 409 (`rescore_mismatch`) with the report; a version other than the server's answers 409
too (the weights that produced the sequence are gone). Without the mode, differences of float
rounding are expected and reported with status 200.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlserve.engine.params import SamplingParams
from rlserve.server.errors import APIError, bad_request
from rlserve.server.state import ServerState, json_body
from rlserve.server.streaming import Run, run_to_end

router = APIRouter()


def _ids(state: ServerState, value: Any, field: str, allow_empty: bool = False) -> list[int]:
    if (
        not isinstance(value, list)
        or (not value and not allow_empty)
        or not all(isinstance(t, int) and not isinstance(t, bool) for t in value)
    ):
        raise bad_request(f"{field} must be a non-empty list of token ids", field)
    state.check_token_ids(value, field)
    return value


def _logprobs(value: Any, count: int) -> list[float]:
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)
    ):
        raise bad_request(f"logprobs must be a list of {count} numbers, one per completion token", "logprobs")
    return [float(v) for v in value]


def compare(completion: list[int], generated: list[float], rescored: list[float]) -> dict[str, Any]:
    """The report: every position whose two logprobs are not the same float."""
    mismatches = [
        {"index": i, "token_id": t, "generated": g, "rescored": r, "abs_diff": abs(g - r)}
        for i, (t, g, r) in enumerate(zip(completion, generated, rescored))
        if g != r and not (math.isnan(g) and math.isnan(r))
    ]
    return {
        "num_tokens": len(completion),
        "num_mismatches": len(mismatches),
        "max_abs_diff": max((m["abs_diff"] for m in mismatches), default=0.0),
        "bitwise_equal": not mismatches,
        "mismatches": mismatches,
        "rescored_logprobs": rescored,
    }


@router.post("/v1/rescore")
async def rescore(request: Request):
    state: ServerState = request.app.state.rlserve
    body = await json_body(request, None)
    state.check_model(body.get("model"))
    prompt = _ids(state, body.get("prompt_ids"), "prompt_ids")
    completion = _ids(state, body.get("completion_ids"), "completion_ids")
    generated = _logprobs(body.get("logprobs"), len(completion))
    version = body.get("policy_version")
    if version is not None and (not isinstance(version, int) or isinstance(version, bool)):
        raise bad_request(
            "policy_version must be an integer (the version that produced the sequence)", "policy_version"
        )
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    run = Run(state, [prompt + completion], params, f"rescore-{uuid.uuid4().hex}", body.get("cache_salt"),
              adapter=state.adapter_for(body.get("model")), stream=False)  # fmt: skip
    (out,) = await run_to_end(request, run)
    scored_version = out.outputs[0].policy_version
    if scored_version is None:
        scored_version = state.engine.policy_version
    if version is not None and scored_version != version:
        raise APIError(409, f"the sequence came from policy_version {version} and the server now serves "
                       f"{scored_version}: re-score it before the next update", param="policy_version",
                       type="ConflictError")  # fmt: skip
    start = len(prompt)
    rescored = [out.prompt_logprobs[start + i][t] for i, t in enumerate(completion)]
    invariant = bool(state.config.engine.batch_invariant)
    report = {
        "policy_version": scored_version,
        "batch_invariant": invariant,
        **compare(completion, generated, rescored),
    }
    if invariant and not report["bitwise_equal"]:
        error = APIError(409, f"{report['num_mismatches']} of {len(completion)} logprobs differ from the re-score "
                         "under engine.batch_invariant (max abs diff "
                         f"{report['max_abs_diff']:.3g})", param="logprobs", type="ConflictError").body()  # fmt: skip
        error["error"]["code"] = "rescore_mismatch"
        return JSONResponse(status_code=409, content={**error, **report})
    return report
