"""With a reasoning parser, an output constraint starts where the reasoning ends, as in vLLM.

A request that thinks (`<think>…</think>` or its family's tags) is left free to reason first: the grammar
becomes "reasoning, then the constraint". Where the prompt already opened the reasoning (DeepSeek-R1's
template ends with `<think>`), the output must close it before the constrained part; where the template
closed it (thinking off), nothing changes; otherwise the reasoning block is optional. The constrained
part is the request's own grammar, referenced whole (llguidance's `@name`), so every constraint kind
(JSON schema, regex, choice, grammar, structural tag, tool_choice) composes the same way.
"""

from __future__ import annotations

import json
from typing import Any

from rlserve.engine.params import SamplingParams
from rlserve.engine.structured import CHECKED
from rlserve.server.parsers.reasoning import reasoning_tags

ANSWER = "answer_after_reasoning"


def constrain_after_reasoning(
    checker: Any,
    tokenizer: Any,
    params: SamplingParams,
    reasoning_parser: str | None,
    enable_thinking: bool | None,
    prompt_ids: list[int],
) -> None:
    """Rewrite `params.structured_outputs` (a checked grammar) to start after the reasoning, if it reasons."""
    spec = params.structured_outputs
    tags = reasoning_tags(reasoning_parser, enable_thinking)
    if tags is None or not isinstance(spec, dict) or set(spec) != {CHECKED}:
        return
    tail = tokenizer.decode(prompt_ids[-16:]).rstrip()
    if tail.endswith(tags.end):
        return  # the template closed the reasoning: the answer starts at once
    added = set(tokenizer.get_added_vocab())
    reasoning = _reasoning_rule(tags.start, tags.end, added, opened=tail.endswith(tags.start))
    params.structured_outputs = {CHECKED: checker.validated(_compose(reasoning, spec[CHECKED]))}


def _reasoning_rule(start: str, end: str, added: set[str], opened: bool) -> str:
    """Lark rules where `start` is the reasoning (closed by `end`) then `@ANSWER`."""
    ws = r"/[ \t\n]*/"
    if end in added:  # a special token cannot occur inside text: the text runs until the token
        body, rules = f"/(?s:.*)/ {end}", ""
    else:
        body, rules = "thought", f"thought[stop={json.dumps(end)}]: /(?s:.*)/\n"
    if opened:
        return f"start: {body} {ws} @{ANSWER}\n{rules}"
    opening = start if start in added else json.dumps(start)
    return f"start: ({opening} {body} {ws})? @{ANSWER}\n{rules}"


def _compose(lark: str, inner: str) -> str:
    """One llguidance grammar: `lark` first, the inner grammar (and any it references) as `@ANSWER`."""
    grammars: list[dict[str, Any]] = (
        json.loads(inner)["grammars"] if inner.lstrip().startswith("{") else [{"lark_grammar": inner}]
    )
    grammars[0] = {**grammars[0], "name": ANSWER}
    return json.dumps({"grammars": [{"name": "reasoning_then_answer", "lark_grammar": lark}, *grammars]})
