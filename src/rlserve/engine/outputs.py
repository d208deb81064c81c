"""What the engine hands back for each request after every step that touched it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

FinishReason = Literal["stop", "length", "abort"]


@dataclass(slots=True)
class VersionSpan:
    """Completion tokens [start, end) were produced under `policy_version`, then labelled `weight_version`."""

    policy_version: int
    start: int
    end: int
    weight_version: str = "default"


@dataclass(slots=True)
class CompletionOutput:
    """One sample of a request. Lists are cumulative: the server diffs them for streaming."""

    index: int
    token_ids: list[int]
    text: str
    # logprob of each sampled token (len == len(token_ids)), when logprobs were asked for
    logprobs: list[float] | None
    # per token: {token_id: logprob} holding the k best (descending), when logprobs > 0
    top_logprobs: list[dict[int, float]] | None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # matched stop string or stop token id; None for EOS/length
    version_spans: list[VersionSpan] = field(default_factory=list)
    # router replay (enable_return_routed_experts), once finished: the top-k expert ids of every
    # forwarded position (prompt + completion - 1), [positions, MoE layers, top_k] uint8/uint16
    routed_experts: np.ndarray | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def policy_version(self) -> int | None:
        return self.version_spans[-1].policy_version if self.version_spans else None

    @property
    def weight_version(self) -> str | None:
        return self.version_spans[-1].weight_version if self.version_spans else None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    # per prompt position: None for the first, then {token_id: logprob} with the actual token + k best
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    finished: bool = False
    # the first ranks for prompt_logprobs entries: {token_id: rank} per position (rank 1 = best)
    prompt_logprob_ranks: list[dict[int, int] | None] | None = None
    # prefill side of P/D: where the decode server finds this request's KV (echoed top-level)
    kv_transfer_params: dict | None = None
    max_batch_size: int = 0  # most sequences in any engine step that ran this request (MLX metadata.batch_size)
    queue_seconds: float | None = None  # engine arrival to first scheduled (vllm:request_queue_time_seconds)
