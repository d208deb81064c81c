"""Where a request starts and stops: its prompt as token ids (checked against the vocabulary), and after each
sampled token whether its sequence is done, and why (stop token, EOS, stop string, detector, length)."""

from __future__ import annotations

from typing import Any

from rlserve.engine.sequence import Sequence


def prompt_ids(prompt: str | list[int], tokenizer: Any, vocab_size: int) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty: send at least one character or token id")
        return tokenizer.encode(prompt, add_special_tokens=True)
    if not isinstance(prompt, list) or not prompt:
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")
    for t in prompt:
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise ValueError(f"prompt token id {t!r} is out of vocabulary (ids run 0 to {vocab_size - 1})")
    return list(prompt)


def finish_reason(
    seq: Sequence, token: int, eos_token_ids: set[int] | frozenset[int] | list[int], max_model_len: int
) -> tuple[str | None, str | int | None]:
    """(finish_reason, stop_reason) once `token` ends `seq`, else (None, None). Feeds the token to the
    sequence's stop-string detokenizer."""
    p = seq.params
    n_out = seq.num_output_tokens
    reason = stop_reason = None
    if seq.detected is not None:  # this token is the EOS forced after the detection
        reason, stop_reason = "stop", seq.detected
    elif token in p.stop_token_ids and n_out > p.min_tokens - 1:
        reason, stop_reason = "stop", token
    elif token in eos_token_ids and not p.ignore_eos and n_out >= p.min_tokens:
        reason = "stop"
    if seq.detok is not None and reason is None:
        matched = seq.detok.feed(token)
        if matched is not None and n_out >= p.min_tokens:
            reason, stop_reason = "stop", matched
    elif seq.detok is not None and p.include_stop_str_in_output and stop_reason is not None:
        seq.detok.feed(token)
    if reason is None and (n_out >= seq.request.max_tokens or len(seq.token_ids) >= max_model_len):
        reason = "length"
    return reason, stop_reason
