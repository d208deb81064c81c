"""Incremental detokenization that never splits a multi-byte character, plus stop-string matching."""

from __future__ import annotations

from dataclasses import dataclass, field

# a few prompt tokens of left context keep tokenizers that merge leading spaces (sentencepiece) honest
_CONTEXT_TOKENS = 5


@dataclass(slots=True)
class IncrementalDetokenizer:
    tokenizer: object
    skip_special_tokens: bool
    stop: list[str]
    include_stop_str_in_output: bool
    ids: list[int] = field(default_factory=list)  # prompt context + completion tokens fed so far
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""

    @classmethod
    def create(cls, tokenizer, prompt_ids: list[int], params) -> IncrementalDetokenizer:
        context = list(prompt_ids[-_CONTEXT_TOKENS:])
        d = cls(tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output)
        d.ids = context
        d.prefix_offset = 0
        d.read_offset = len(context)
        return d

    def feed(self, token_id: int) -> str | None:
        """Append one token; returns the matched stop string when the text now contains one."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens)
        full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete UTF-8 sequence: wait for the next token
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._append(delta)

    def flush(self) -> None:
        """At the end of generation, emit whatever is still held back (even a broken character)."""
        if self.read_offset < len(self.ids):
            decode = self.tokenizer.decode
            prefix = decode(
                self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
            )
            full = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
            self.read_offset = len(self.ids)
            self.text += full[len(prefix) :]

    def _append(self, delta: str) -> str | None:
        start = max(0, len(self.text) - self.max_stop_len + 1)
        self.text += delta
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1:
                self.text = self.text[: i + len(s)] if self.include_stop_str_in_output else self.text[:i]
                return s
        return None

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)

    def visible_text(self, finished: bool) -> str:
        """Text safe to show now: a suffix that may still grow into a stop string is held back."""
        hold = self.max_stop_len - 1
        if finished or hold <= 0:
            return self.text
        return self.text[: max(0, len(self.text) - hold)]
