"""Structured-output request fields, as vLLM's API spells them, into the engine's one constraint spec.

Accepted (one constraint per request): `response_format` json_object / json_schema / structural_tag;
`structured_outputs` {json, json_object, regex, choice, grammar, structural_tag}; the older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (also via the SDK's extra_body,
which arrives at the top level); and `allowed_token_ids`. tool_choice "required" or a named function
becomes a grammar in the configured tool parser's format (server/tool_grammar.py).
"""

from __future__ import annotations

import json
from typing import Any

from rlserve.engine.params import SamplingParams
from rlserve.engine.structured import CHECKED, GrammarChecker
from rlserve.server.errors import bad_request
from rlserve.server.tool_grammar import tool_call_constraint

GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
SPEC_KEYS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# which distribution a response's logprobs come from, named in this header on every response
LOGPROBS_HEADER = "X-Logprobs-Distribution"


_CHECKERS: dict[int, GrammarChecker] = {}


def grammar_checker(engine: Any) -> GrammarChecker:
    checker = _CHECKERS.get(id(engine))
    if checker is None:
        checker = _CHECKERS[id(engine)] = GrammarChecker(engine.tokenizer, engine.vocab_size)
    return checker


def checked(engine: Any, spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """Validated here, in the API process, so the engine compiles it off its step loop unchecked;
    ValueError (a 400) names the problem."""
    if spec is None:
        return None
    return {CHECKED: grammar_checker(engine).grammar(spec)}


def constraint(extra: dict[str, Any]) -> dict[str, Any] | None:
    """The engine's structured_outputs spec from a request body's extra fields (None: unconstrained)."""
    found: list[tuple[str, dict[str, Any]]] = []
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request(
                'structured_outputs must be an object such as {"json": {...}} or {"regex": "..."}', "structured_outputs"
            )
        spec = {k: so[k] for k in SPEC_KEYS if so.get(k) not in (None, False)}
        if spec:
            found.append(("structured_outputs", spec))
    for field, key in GUIDED_FIELDS.items():
        if extra.get(field) is not None:
            found.append((field, {key: extra[field]}))
    if extra.get("guided_json_object"):
        found.append(("guided_json_object", {"json_object": True}))
    fmt = extra.get("response_format")
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    if len(found) > 1:
        names = [name for name, _ in found]
        raise bad_request(f"send one output constraint, got {names}; drop all but one", names[1])
    if not found:
        return None
    name, spec = found[0]
    if len(spec) != 1:
        raise bad_request(f"{name} must set exactly one of {list(SPEC_KEYS)}, got {sorted(spec)}", name)
    return spec


def _response_format(fmt: Any) -> dict[str, Any] | None:
    if not isinstance(fmt, dict):
        raise bad_request("response_format must be an object with a type", "response_format")
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        body = fmt.get("json_schema")
        schema = body.get("schema", body.get("json_schema")) if isinstance(body, dict) else None
        if not isinstance(schema, (dict, str)):
            raise bad_request(
                'response_format json_schema needs {"json_schema": {"name": ..., "schema": {...}}}', "response_format"
            )
        return {"json": schema}
    if kind == "structural_tag":
        if "structures" not in fmt:
            raise bad_request(
                'response_format structural_tag needs "structures" and "triggers" '
                "(the format-object form is not supported)",
                "response_format",
            )
        return {"structural_tag": json.dumps({"structures": fmt["structures"], "triggers": fmt.get("triggers", [])})}
    raise bad_request(
        f"response_format type must be text, json_object, json_schema or structural_tag, got {kind!r}",
        "response_format",
    )


def allowed_token_ids(extra: dict[str, Any]) -> list[int] | None:
    ids = extra.get("allowed_token_ids")
    if ids is None:
        return None
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise bad_request("allowed_token_ids must be a non-empty list of token ids", "allowed_token_ids")
    return ids


def logprobs_header(params: SamplingParams, server_mode: str) -> dict[str, str]:
    """`processed`: the distribution sampled from (masked and renormalised when constrained); `raw`: the model's."""
    mode = params.logprobs_mode or server_mode
    suffix = "-logits" if mode.endswith("logits") else ""
    if mode.startswith("raw"):
        return {LOGPROBS_HEADER: "raw" + suffix}
    constrained = params.structured_outputs is not None or params.allowed_token_ids is not None
    return {LOGPROBS_HEADER: ("processed-masked-renormalized" if constrained else "processed") + suffix}


def check_auto_tool_choice(parser: str | None, body: Any) -> None:
    """vLLM's 400 for an explicit tool_choice "auto" on chat with no parser configured: nothing would parse
    the calls."""
    if body.tools and parser is None and body.tool_choice == "auto":
        raise bad_request(
            '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
            "(rlserve: --model.tool_call_parser NAME), or leave tool_choice unset",
            "tool_choice",
        )


def enforce_tool_choice(parser: str | None, engine: Any, body: Any, params: SamplingParams) -> None:
    """tool_choice "required" / named: constrain decoding to the parser's call format (after its checks)."""
    tools = [t.model_dump() for t in body.tools] if body.tools else None
    parallel = getattr(body, "parallel_tool_calls", None)
    if parallel is None:
        parallel = (body.model_extra or {}).get("parallel_tool_calls", True)
    added = set(engine.tokenizer.get_added_vocab()) if tools else set()
    spec = tool_call_constraint(parser, tools, body.tool_choice, added, parallel is not False)
    if spec is None:
        return
    if params.structured_outputs is not None:
        raise bad_request(
            'tool_choice "required" or a named function cannot be combined with another output '
            "constraint; drop response_format / structured_outputs",
            "tool_choice",
        )
    try:
        params.structured_outputs = checked(engine, spec)
    except ValueError as e:
        raise bad_request(f"tool_choice: the tools' parameters do not make a valid grammar: {e}", "tools") from None
