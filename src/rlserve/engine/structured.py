"""Constrained decoding: JSON schema, regex, choice and grammar constraints as per-row token masks.

A request's `structured_outputs` (vLLM's StructuredOutputsParams shape: one of json, json_object,
regex, choice, grammar, structural_tag) becomes an llguidance grammar. Grammars are checked when
the request is made (a bad one is a ValueError naming the problem, so a 400), compiled on a small
thread pool off the step loop and cached by their text; every sequence gets its own matcher, a
copy of the compiled one. Each step the engine asks for the allowed-token mask of the constrained
rows only, so constrained and free sequences share the batch; the sampler masks those rows before
temperature and top-k/p, so the processed distribution (and its logprobs) is the masked,
renormalised one the token was drawn from, and `raw` logprobs stay the model's own.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
# a spec the API server already turned into llguidance's grammar text and validated (GrammarChecker):
# the engine compiles it on its pool without checking it again on the step loop
CHECKED = "llguidance"
# stop_reason of a sequence whose grammar left no token it could take (finish_reason "stop")
DEAD_END = "structured_outputs: no token can continue the grammar"
_CACHE_SIZE = 256
# at most one space between JSON tokens: compact and json.dumps' ", " / ": " both pass, while a weak
# model cannot spend its budget on whitespace (free whitespace would let it)
JSON_WHITESPACE = {"whitespace_pattern": "[ ]?"}
_BIT = torch.arange(32, dtype=torch.int32)


def grammar_text(spec: dict[str, Any]) -> str:
    """The llguidance grammar for one structured_outputs spec; ValueError names what is wrong."""
    import llguidance

    kinds = [k for k in STRUCTURED_KINDS if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise ValueError(f"structured_outputs must set exactly one of {list(STRUCTURED_KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    matcher = llguidance.LLMatcher
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else value
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs json is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError("structured_outputs json must be a JSON schema object")
        return matcher.grammar_from_json_schema(json.dumps(schema), overrides=JSON_WHITESPACE)
    if kind == "regex":
        _require_str(kind, value)
        return matcher.grammar_from_regex(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise ValueError("structured_outputs choice must be a non-empty list of strings")
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in value))
    if kind == "grammar":
        _require_str(kind, value)
        from llguidance.gbnf_to_lark import any_to_lark  # GBNF (llama.cpp, xgrammar EBNF) or Lark as is

        return matcher.grammar_from_lark(any_to_lark(value))
    return _structural_tag(value)


def _require_str(kind: str, value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"structured_outputs {kind} must be a non-empty string")


def _structural_tag(value: Any) -> str:
    """vLLM's structural_tag {"structures": [{"begin", "schema", "end"}], "triggers": [...]}."""
    from llguidance import LLMatcher, StructTag

    tag = json.loads(value) if isinstance(value, str) else value
    if not isinstance(tag, dict) or not isinstance(tag.get("structures"), list) or not tag["structures"]:
        raise ValueError(
            'structured_outputs structural_tag must be {"structures": [{"begin", "schema", "end"}], "triggers": [...]}'
        )
    triggers = tag.get("triggers") or []
    tags = []
    for s in tag["structures"]:
        begin = s.get("begin", "") if isinstance(s, dict) else ""
        trigger = next((t for t in triggers if begin.startswith(t)), begin)
        if not begin or not isinstance(s.get("schema"), dict):
            raise ValueError("every structural_tag structure needs a non-empty begin and a JSON schema")
        tags.append(StructTag(trigger=trigger, begin=begin, grammar=s["schema"], end=s.get("end", "")))
    grammar = StructTag.to_grammar(tags)
    return grammar if grammar.startswith("{") else LLMatcher.grammar_from_lark(grammar)


class GrammarChecker:
    """Spec -> validated llguidance grammar text (any thread; remembers what it has validated)."""

    def __init__(self, tokenizer, vocab_size: int):
        self.vocab_size = vocab_size
        self._hf_tokenizer = tokenizer
        self._tokenizer = None
        self._lock = threading.Lock()
        self._valid: OrderedDict[str, None] = OrderedDict()

    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
            return self._tokenizer

    def check_ids(self, allowed_token_ids: list[int] | None) -> None:
        if allowed_token_ids is not None:
            bad = [t for t in allowed_token_ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad or not allowed_token_ids:
                raise ValueError(
                    f"allowed_token_ids must be a non-empty list of ids in [0, {self.vocab_size}), "
                    f"got {bad or allowed_token_ids}"
                )

    def grammar(self, spec: dict[str, Any]) -> str:
        """The validated grammar text of a spec; ValueError says what is wrong with it."""
        if not isinstance(spec, dict):
            raise ValueError("structured_outputs must be an object")  # noqa: TRY004 - a 400 like every params error
        try:
            grammar = grammar_text(spec)
        except ValueError:
            raise
        except Exception as e:  # noqa: BLE001 - llguidance raises plain exceptions on bad input
            raise ValueError(f"structured_outputs: {e}") from None
        return self.validated(grammar)

    def validated(self, grammar: str) -> str:
        """`grammar` (llguidance's text) once llguidance has accepted it; ValueError with its complaint."""
        import llguidance

        if grammar in self._valid:
            return grammar
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer())
        if error:
            raise ValueError(f"structured_outputs: {error.strip()}")
        with self._lock:
            self._valid[grammar] = None
            if len(self._valid) > _CACHE_SIZE:
                self._valid.popitem(last=False)
        return grammar


class StructuredOutputs:
    """Compiled grammars (cached by text), one matcher per constrained sequence, masks per step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], workers: int = 2):
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.checker = GrammarChecker(tokenizer, vocab_size)
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._workers = workers
        self._compiled: OrderedDict[str, Future] = OrderedDict()
        self.compile_seconds = 0.0  # total time spent compiling (off the step loop)
        self.compiled = 0

    def check(self, spec: dict[str, Any] | None, allowed_token_ids: list[int] | None) -> str | None:
        """Validate; starts compiling and returns the grammar text, None if unconstrained. A spec the
        API server checked (CHECKED) is not validated again here, on the step loop."""
        self.checker.check_ids(allowed_token_ids)
        if spec is None:
            return None
        if isinstance(spec, dict) and set(spec) == {CHECKED} and isinstance(spec[CHECKED], str):
            grammar = spec[CHECKED]
        else:
            grammar = self.checker.grammar(spec)
        self._compile(grammar)
        return grammar

    def _compile(self, grammar: str) -> Future:
        with self._lock:
            fut = self._compiled.get(grammar)
            if fut is not None:
                self._compiled.move_to_end(grammar)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix="rlserve-grammar")
            fut = self._pool.submit(self._build, grammar)
            self._compiled[grammar] = fut
            if len(self._compiled) > _CACHE_SIZE:
                self._compiled.popitem(last=False)
            return fut

    def _build(self, grammar: str):
        import time

        import llguidance

        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(self.checker.tokenizer(), grammar)
        with self._lock:
            self.compile_seconds += time.perf_counter() - t0
            self.compiled += 1
        return matcher

    def matcher_for(self, grammar: str):
        """A fresh matcher for one sequence (waits only if its compile is still running); None if it failed."""
        try:
            return self._compile(grammar).result().deep_copy()
        except Exception:  # noqa: BLE001 - an unchecked grammar that llguidance refused ends its sequence, not the engine
            return None

    def masks(self, seqs: list) -> list[torch.Tensor | None]:
        """Per sequence, the bool [vocab] mask of tokens it may take next (None: unconstrained)."""
        out: list[torch.Tensor | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.grammar is not None or s.params.allowed_token_ids is not None]
        if not rows:
            return out
        import llguidance.torch as lt  # here: its import took ~0.5 s of a server's first unconstrained step

        allowed = torch.ones(len(rows), self.vocab_size, dtype=torch.bool)
        matched = [j for j, i in enumerate(rows) if seqs[i].grammar is not None]
        if matched:
            bitmask = lt.allocate_token_bitmask(len(matched), self.vocab_size)
            for k, j in enumerate(matched):
                seq = seqs[rows[j]]
                if seq.matcher is None:
                    seq.matcher = self.matcher_for(seq.grammar)
                if seq.matcher is None or seq.matcher.is_error():  # failed to compile: allows nothing, a dead end
                    bitmask[k] = 0
                    continue
                lt.fill_next_token_bitmask(seq.matcher, bitmask, k)
            allowed[matched] = ((bitmask.unsqueeze(-1) >> _BIT) & 1).bool().flatten(1)[:, : self.vocab_size]
            eos = list(self.eos_token_ids)
            for j in matched:  # any of the engine's EOS ids ends an accepted grammar
                matcher = seqs[rows[j]].matcher
                if eos and matcher is not None and not matcher.is_error() and matcher.is_accepting():
                    allowed[j, eos] = True
        for j, i in enumerate(rows):
            ids = seqs[i].params.allowed_token_ids
            if ids is not None:
                only = torch.zeros(self.vocab_size, dtype=torch.bool)
                only[ids] = True
                allowed[j] &= only
            out[i] = allowed[j]
        return out

    def advance(self, seq, token: int) -> bool:
        """Feed the sampled token to the sequence's matcher; False when the grammar is at a dead end."""
        matcher = seq.matcher
        if matcher is None:
            return True
        if token in self.eos_token_ids and matcher.is_accepting():
            return True
        if not matcher.consume_token(token) or matcher.is_error():
            return False
        return not (matcher.is_stopped() and not matcher.is_accepting())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
