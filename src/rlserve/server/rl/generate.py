"""Token-in/token-out generation routes: vLLM's /inference/v1/generate and the shared /generate path
(TRL legacy, SGLang native, MLX-style RL server; dispatched on the body, docs/protocols.md §2.0)."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from rlserve.engine.outputs import CompletionOutput, RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.engine.routing import encode_routed_experts
from rlserve.server.errors import bad_request, from_value_error
from rlserve.server.limits import check_text_fits
from rlserve.server.openapi import documented
from rlserve.server.rl.protocol_native import (
    GENERATE_BODIES,
    InferenceGenerateRequest,
    SGLangGenerateRequest,
    TRLGenerateRequest,
    generate_body_model,
)
from rlserve.server.sampling import forced_token_ids, kv_transfer_params, logit_bias
from rlserve.server.staleness import hold_for_policy_version
from rlserve.server.state import (
    SAMPLING_FIELDS,
    ServerState,
    cached_tokens,
    clamp,
    json_body,
    prompt_logprobs_json,
    sampled_first,
    usage,
    validated,
    version_fields,
)
from rlserve.server.streaming import SSE_DONE, Run, SSEResponse, run_to_end, sse, sse_error, start_stream

router = APIRouter()
_PARAM_NAMES = frozenset(SamplingParams.__dataclass_fields__) - {"logprobs_mode", "detokenize"}


def _state(request: Request) -> ServerState:
    return request.app.state.rlserve


def make_params(fields: dict[str, Any], **overrides: Any) -> SamplingParams:
    kwargs = {k: v for k, v in fields.items() if k in _PARAM_NAMES and v is not None}
    if kwargs.get("top_k") == 0:
        kwargs["top_k"] = -1
    if kwargs.pop("no_stop_trim", False):
        kwargs["include_stop_str_in_output"] = True
    if kwargs.get("logit_bias") is not None:
        kwargs["logit_bias"] = logit_bias(kwargs["logit_bias"])
    kwargs.update({k: v for k, v in overrides.items() if v is not None or k == "logprobs"})
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise from_value_error(ValueError(str(exc)), SAMPLING_FIELDS) from None


def _token_ids(state: ServerState, ids: Any, field: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request(f"{field} must be a non-empty list of token ids", field)
    state.check_token_ids(ids, field)
    return ids


def _logprob_content(comp: CompletionOutput) -> dict | None:
    # vLLM 0.32's {token_id, logprob, rank}, and `token: "token_id:<id>"` beside it for verifiers' client
    # (its renderers reject decoded text)
    if comp.logprobs is None:
        return None
    tops = comp.top_logprobs or [{} for _ in comp.token_ids]
    content = []
    for t, lp, top in zip(comp.token_ids, comp.logprobs, tops):
        ranks = {i: rank for rank, i in enumerate(sorted(top, key=top.__getitem__, reverse=True), 1)}
        entry = _logprob_entry(t, lp, ranks.get(t))  # the sampled token's rank is known when it is a top one
        entry["top_logprobs"] = [_logprob_entry(i, v, ranks.get(i)) for i, v in sampled_first(t, lp, top)]
        content.append(entry)
    return {"content": content}


def _logprob_entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"token_id": token_id, "token": f"token_id:{token_id}", "logprob": clamp(logprob), "rank": rank}


# ---- vLLM /inference/v1/generate (§2.6) ----------------------------------------------------------


@router.post("/inference/v1/generate", openapi_extra=documented(InferenceGenerateRequest))
async def inference_generate(request: Request):
    state, body = _state(request), await json_body(request, InferenceGenerateRequest)
    state.check_model(body.get("model"))
    await hold_for_policy_version(state, body)
    prompt = _token_ids(state, body.get("token_ids"), "token_ids")
    sp = body.get("sampling_params") or {}
    if not isinstance(sp, dict):
        raise bad_request("sampling_params must be an object", "sampling_params")
    if sp.get("prompt_logprobs") is not None and body.get("stream"):
        raise bad_request("prompt_logprobs is not available with stream=true", "prompt_logprobs")
    params = make_params(
        sp,
        forced_token_ids=forced_token_ids(state, body),
        kv_transfer_params=kv_transfer_params(
            body.get("kv_transfer_params") or sp.get("kv_transfer_params"), sp.get("extra_args")
        ),
    )
    experts_start = _routed_experts_start(sp.get("routed_experts_prompt_start"))
    rid = request.headers.get("x-request-id") or body.get("request_id") or uuid.uuid4().hex
    as_ids = bool(sp.get("return_tokens_as_token_ids") or body.get("return_tokens_as_token_ids"))
    run = Run(
        state,
        [prompt],
        params,
        rid,
        body.get("cache_salt"),
        adapter=state.adapter_for(body.get("model")),
        stream=bool(body.get("stream")),
    )
    if body.get("stream"):
        await start_stream(request, run)
        return SSEResponse(_generate_stream(state, run, rid, body))
    (out,) = await run_to_end(request, run)
    text = body.get("output_mode") == "text"
    return {
        "request_id": rid,
        "model": state.served_model_name,
        "created": int(time.time()),
        "output_mode": "text" if text else "tokens",
        "choices": [
            {
                "index": c.index,
                "token_ids": c.token_ids,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
                "logprobs": _logprob_content(c),
                "routed_experts": _routed_experts(c, experts_start),
                "sampling_mask": None,
                **version_fields(state, c),
                **({"text": c.text or state.tokenizer.decode(c.token_ids)} if text else {}),
            }
            for c in out.outputs
        ],
        "prompt_logprobs": prompt_logprobs_json(state, out, params.prompt_logprobs, as_ids),
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": out.prompt_token_ids if body.get("return_token_ids") else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": out.kv_transfer_params,
        "ec_transfer_params": None,
        "usage": _usage(out, state),
    }


def _routed_experts_start(value: Any) -> int:
    if value is None:
        return 0
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise bad_request(
            f"routed_experts_prompt_start must be an integer >= 0, got {value!r}", "routed_experts_prompt_start"
        )
    return value


def _routed_experts(c: CompletionOutput, start: int) -> dict | None:
    """docs/protocols.md §2.14; None unless the server runs with enable_return_routed_experts."""
    return None if c.routed_experts is None else encode_routed_experts(c.routed_experts, start)


def _usage(out: RequestOutput, state: ServerState) -> dict:
    return usage(
        len(out.prompt_token_ids),
        sum(len(c.token_ids) for c in out.outputs),
        cached_tokens(state, out.num_cached_tokens),
    )


async def _generate_stream(state: ServerState, run: Run, rid: str, body: dict[str, Any]):
    head = {"request_id": rid, "usage": None, "output_mode": "text" if body.get("output_mode") == "text" else "tokens"}
    options = body.get("stream_options")
    include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    last: RequestOutput | None = None
    sent: dict[int, int] = {}
    try:
        async for _, out in run.events():
            for c in out.outputs:
                start = sent.get(c.index, 0)
                if start == len(c.token_ids) and not c.finished:
                    continue
                sent[c.index] = len(c.token_ids)
                delta = CompletionOutput(
                    c.index,
                    c.token_ids[start:],
                    "",
                    c.logprobs[start:] if c.logprobs is not None else None,
                    c.top_logprobs[start:] if c.top_logprobs is not None else None,
                )
                choice = {
                    "index": c.index,
                    "token_ids": delta.token_ids,
                    "logprobs": _logprob_content(delta),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason if c.finished else None,
                    "routed_experts": None,
                    "sampling_mask": None,
                    "weight_versions": None,
                }
                if c.finished:
                    choice.update(version_fields(state, c))
                yield sse({**head, "choices": [choice]})
            last = out
        if include_usage and last is not None:
            counts = _usage(last, state)
            counts = {k: counts[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
            yield sse({**head, "usage": counts, "choices": []})
        yield SSE_DONE
    except Exception as exc:
        yield sse_error(exc)
        yield SSE_DONE
    finally:
        await run.close()


# ---- /generate: TRL legacy, SGLang, MLX ----------------------------------------------------------


@router.post("/generate", openapi_extra=documented(*GENERATE_BODIES))
async def generate(request: Request):
    state, raw = _state(request), await json_body(request)
    model = generate_body_model(raw)
    if model is None:
        raise bad_request("/generate needs `prompts` (TRL), `input_ids`/`text` (SGLang) or `prompt` (MLX-style)")
    body = validated(raw, model)
    await hold_for_policy_version(state, body)
    if model is TRLGenerateRequest:
        return await _trl_generate(request, state, body)
    if model is SGLangGenerateRequest:
        return await _sglang_generate(request, state, body)
    return await _mlx_generate(request, state, body)


def _prompt_list(state: ServerState, prompts: Any, field: str) -> list[list[int]]:
    if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
        prompts = [prompts]
    if not isinstance(prompts, list) or not prompts:
        raise bad_request(f"{field} must be a string, a list of strings, or token-id lists", field)
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request(f"{field} holds an empty prompt", field)
            check_text_fits(state, len(p), field)
            out.append(state.tokenizer.encode(p, add_special_tokens=True))
        else:
            out.append(_token_ids(state, p, field))
    return out


async def _run_all(request: Request, state: ServerState, prompts, params, rid, salt=None, adapter=None):
    run = Run(state, prompts, params, rid, salt, adapter=adapter, stream=False)
    return await run_to_end(request, run)


async def _mlx_generate(request: Request, state: ServerState, body: dict):
    prompts = await state.off_loop(_prompt_list, state, body["prompt"], "prompt")
    fields = {"temperature": 0.0, "max_tokens": state.config.server.generate_max_tokens, **body}
    params = make_params(fields, logprobs=0)
    rid = body.get("request_id") or uuid.uuid4().hex
    started = time.monotonic()
    outs = await _run_all(request, state, prompts, params, rid, adapter=state.adapter_for(None))
    latency = (time.monotonic() - started) * 1000
    current = state.engine.policy_version
    batch_size = max((out.max_batch_size for out in outs), default=0)  # the batch the engine formed
    results = []
    for out in outs:
        for c in out.outputs:
            results.append(
                {
                    "request_id": rid,
                    "policy_version": c.policy_version if c.policy_version is not None else current,
                    "step_id": body.get("step_id"),
                    "prompt_ids": out.prompt_token_ids,
                    "completion_ids": c.token_ids,
                    "text": c.text,
                    "logprobs": [clamp(x) for x in c.logprobs or []],
                    "finish_reason": c.finish_reason,
                    "metadata": {
                        "batch_size": batch_size,
                        "latency_ms": round(latency, 3),
                        "current_policy_version": current,
                    },
                }
            )
    if len(results) == 1 and not isinstance(body["prompt"], list):
        return results[0]
    for i, r in enumerate(results):
        r["request_id"] = f"{rid}-{i}"
    return {"results": results}


async def _trl_generate(request: Request, state: ServerState, body: dict):
    fields = {"max_tokens": 16, **body, **(body.get("generation_kwargs") or {})}
    prompts = await state.off_loop(_prompt_list, state, body["prompts"], "prompts")
    if fields.get("truncate_prompt_tokens"):
        prompts = [p[-int(fields["truncate_prompt_tokens"]) :] for p in prompts]
    k = fields.get("logprobs")
    params = make_params(fields, logprobs=k)
    outs = await _run_all(request, state, prompts, params, uuid.uuid4().hex)
    completions = [c for out in outs for c in out.outputs]
    result: dict[str, Any] = {
        "prompt_ids": [o.prompt_token_ids for o in outs],
        "completion_ids": [c.token_ids for c in completions],
    }
    if k is None:
        result |= {"logprobs": None, "logprob_token_ids": None}
        return result
    lps, ids = [], []
    for c in completions:
        seq_lp, seq_ids = [], []
        for pos, (t, lp) in enumerate(zip(c.token_ids, c.logprobs)):
            alts = sorted((c.top_logprobs[pos] if c.top_logprobs else {}).items(), key=lambda kv: -kv[1])
            entry = [(t, lp)] + [(i, v) for i, v in alts if i != t][:k]
            entry.sort(key=lambda kv: -kv[1])
            seq_ids.append([i for i, _ in entry])
            seq_lp.append([v if math.isfinite(v) else None for _, v in entry])  # §2.0: TRL legacy -inf is null
        lps.append(seq_lp)
        ids.append(seq_ids)
    return result | {"logprobs": lps, "logprob_token_ids": ids}


async def _sglang_generate(request: Request, state: ServerState, body: dict):
    if body.get("stream"):
        raise bad_request("streaming on SGLang's /generate is not supported; use /inference/v1/generate", "stream")
    single = not (
        isinstance(body.get("input_ids"), list) and body["input_ids"] and isinstance(body["input_ids"][0], list)
    )
    source = body.get("input_ids") if body.get("input_ids") is not None else body.get("text")
    prompts = await state.off_loop(
        _prompt_list, state, source, "input_ids" if body.get("input_ids") is not None else "text"
    )
    sp = dict(body.get("sampling_params") or {})
    sp["max_tokens"] = sp.pop("max_new_tokens", 128)
    want_lp = bool(body.get("return_logprob"))
    want_experts = bool(body.get("return_routed_experts"))
    if want_experts and not state.config.enable_return_routed_experts:
        raise bad_request(
            "return_routed_experts needs a server started with --enable_return_routed_experts", "return_routed_experts"
        )
    experts_start = _routed_experts_start(
        body.get("routed_experts_prompt_start", sp.pop("routed_experts_prompt_start", None))
    )
    params = make_params(sp, logprobs=int(body.get("top_logprobs_num") or 0) if want_lp else None)
    rid = body.get("rid") or uuid.uuid4().hex
    lora = body.get("lora_path")
    adapter = state.check_adapter(lora, "lora_path") if lora else None
    outs = await _run_all(request, state, prompts, params, rid, adapter=adapter)
    results = []
    for out in outs:
        for c in out.outputs:
            matched = c.stop_reason
            meta = {
                "id": rid,
                "finish_reason": {"type": c.finish_reason, "matched": matched},
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": len(c.token_ids),
                "cached_tokens": out.num_cached_tokens,
                **version_fields(state, c),
                "output_token_logprobs": [[clamp(lp), t, None] for t, lp in zip(c.token_ids, c.logprobs)]
                if want_lp
                else None,
                "input_token_logprobs": None,
                "output_top_logprobs": None,
            }
            if want_experts:
                meta["routed_experts"] = _routed_experts(c, experts_start)
            results.append({"text": c.text, "output_ids": c.token_ids, "meta_info": meta})
    return JSONResponse(results[0] if single and len(results) == 1 else results)
