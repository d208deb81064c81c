"""Integers a request sends to an engine core process, brought into the wire's 64-bit range first.

JSON integers have no size limit, but the msgpack frames to the engine process carry only
[-2**63, 2**64 - 1]. Where a larger value means the same as the largest one (a max_tokens past
the context, a top_k past the vocabulary, a seed the engine reduces modulo 2**63) it is clamped;
where it can only be a mistake (a token id, a logprobs count past the server's cap) it is the
ValueError naming the field that the in-thread engine would raise. The result: the same answer
from the in-thread engine and the engine process, and never an encoding failure (a 500).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from rlserve.engine.params import SamplingParams

INT64_MAX = (1 << 63) - 1
WIRE_MIN, WIRE_MAX = -(1 << 63), (1 << 64) - 1
TOKEN_ID_FIELDS = ("stop_token_ids", "forced_token_ids")


def fits_wire(value: int) -> bool:
    return WIRE_MIN <= value <= INT64_MAX


def wire_safe(prompt: list[int] | str, params: SamplingParams, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """`params` with every integer inside 64 bits; ValueError naming the field where it cannot be."""
    if not isinstance(prompt, str):
        for t in prompt:
            if isinstance(t, int) and not fits_wire(t):
                raise ValueError(f"prompt token id {t} is out of vocabulary (ids run 0 to {vocab_size - 1})")
    changes: dict[str, Any] = {}
    for name in ("max_tokens", "min_tokens", "top_k"):  # past the context or the vocabulary: the same as the cap
        value = getattr(params, name)
        if value is not None and value > INT64_MAX:
            changes[name] = INT64_MAX
    if params.seed is not None and not fits_wire(params.seed):
        changes["seed"] = params.seed % (1 << 63)  # the engine seeds with (seed + j * step) mod 2**63
    for name in TOKEN_ID_FIELDS:
        bad = [t for t in getattr(params, name) or [] if not fits_wire(t)]
        if bad:
            raise ValueError(f"{name} {bad} are outside the vocabulary [0, {vocab_size})")
    bad = [t for t in params.logit_bias or {} if not fits_wire(t)]
    if bad:
        raise ValueError(f"logit_bias {bad} are outside the vocabulary [0, {vocab_size})")
    for name in ("logprobs", "prompt_logprobs"):
        k = getattr(params, name)
        if k is not None and k > INT64_MAX:
            if max_logprobs != -1:
                raise ValueError(f"{name}={k} exceeds the server's max_logprobs ({max_logprobs})")
            changes[name] = vocab_size  # no cap: every token of the vocabulary
    if params.kv_transfer_params is not None and not _fits_json(params.kv_transfer_params):
        raise ValueError("kv_transfer_params holds an integer outside the 64-bit range")
    return dataclasses.replace(params, **changes) if changes else params


def _fits_json(value: Any) -> bool:
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return WIRE_MIN <= value <= WIRE_MAX
    if isinstance(value, dict):
        return all(_fits_json(k) and _fits_json(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_fits_json(v) for v in value)
    return True
