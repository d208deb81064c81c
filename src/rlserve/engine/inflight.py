"""What happens to the sequences in flight when new weights are committed (`engine.inflight_update_policy`).

- `keep`: they go on over the KV the old weights computed; their spans show the switch (the default).
- `recompute`: their KV is thrown away and recomputed with the new weights (prompt and the tokens
  generated so far, through the scheduler's preemption path) before the next token, so every later
  token and logprob is what a fresh forward of the new weights gives.
- `abort`: they finish now with finish_reason "abort" and the tokens they have (vLLM's way).
- `recompute_if_older_than:N`: recompute only those whose KV was computed N or more versions ago.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rlserve.engine.sequence import Status

_OLDER_THAN = re.compile(r"recompute_if_older_than:(\d+)")


@dataclass(frozen=True, slots=True)
class InflightPolicy:
    action: str  # keep | recompute | abort
    older_than: int = 0  # recompute: only KV computed this many versions ago or more (0: all)

    @classmethod
    def parse(cls, text: str) -> InflightPolicy:
        if text in ("keep", "recompute", "abort"):
            return cls(text)
        match = _OLDER_THAN.fullmatch(text.replace(" ", ""))
        if match is None:
            raise ValueError(
                f"inflight update policy {text!r} is not one of keep, recompute, abort, recompute_if_older_than:N"
            )
        return cls("recompute", int(match.group(1)))


def mark_kv_version(batch, policy_version: int) -> None:
    """Remember the version whose weights compute each sequence's KV from scratch (a step's prefills
    that start at token 0)."""
    for seq, _ in batch.prefills:
        if seq.num_computed_tokens == 0:
            seq.kv_policy_version = policy_version


def apply(engine, policy: InflightPolicy) -> int:
    """Act on the engine's in-flight sequences after a commit that made `engine.policy_version`;
    how many sequences were recomputed or aborted."""
    if policy.action == "keep":
        return 0
    if policy.action == "abort":
        return engine.abort_all()
    current, count = engine.policy_version, 0
    for seq in list(engine.scheduler.running):
        if seq.status is not Status.RUNNING or seq.num_computed_tokens == 0:
            continue
        kv_version = getattr(seq, "kv_policy_version", None)
        if kv_version is None:  # a sample forked from the request's first sequence shares its prompt KV
            kv_version = getattr(seq.request.seqs[0], "kv_policy_version", 0)
        if current - kv_version > policy.older_than:
            engine.scheduler.preempt(seq)
            count += 1
    return count
