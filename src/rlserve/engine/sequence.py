"""A request and its samples (sequences) as the scheduler and the engine see them."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from rlserve.engine.detokenizer import IncrementalDetokenizer
from rlserve.engine.outputs import CompletionOutput, RequestOutput, VersionSpan
from rlserve.engine.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never beyond the end of the context
    cache_salt: str | None = None
    adapter: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # siblings of an n > 1 request exist once the prompt is computed
    started: bool = False  # admitted to the running batch at least once
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[dict[int, int] | None] | None = None
    first_token_time: float | None = None
    queue_seconds: float | None = None  # arrival to first admission into the running batch
    kv_transfer_out: dict | None = None  # prefill side of P/D: where its pinned KV is served
    held_blocks: list[int] = field(default_factory=list)  # pulled KV blocks referenced until admission
    max_batch_size: int = 0  # most sequences in any engine step that ran this request

    @property
    def live_seqs(self) -> list[Sequence]:
        """Sample 0 alone until the prompt is computed and its siblings are forked from it."""
        return self.seqs if self.forked else self.seqs[:1]

    @property
    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.live_seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output() for s in self.live_seqs],
            prompt_logprobs=self.prompt_logprobs,
            prompt_logprob_ranks=self.prompt_logprob_ranks,
            num_cached_tokens=self.num_cached_tokens,
            finished=self.finished,
            kv_transfer_params=self.kv_transfer_out,
            max_batch_size=self.max_batch_size,
            queue_seconds=self.queue_seconds,
        )


class Sequence:
    def __init__(self, request: Request, index: int, generator: torch.Generator | None, detok):
        self.request = request
        self.index = index
        self.params = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # hashes of the leading full, computed blocks
        self.extra_key = b""  # prefix-cache key material, fixed when the scheduler admits it
        self.status = Status.WAITING
        self.generator = generator
        self.detok: IncrementalDetokenizer | None = detok
        self.logprobs: list[float] | None = [] if self.params.logprobs is not None else None
        self.top_logprobs: list[dict[int, float]] | None = [] if self.params.logprobs else None
        self.version_spans: list[VersionSpan] = []
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.last_token_time: float | None = None
        self.confident_run = 0  # consecutive confident tokens (repetition detection)
        self.detected: str | None = None  # the detector that fired; EOS comes next
        self.routed_experts = None  # [positions, sparse layers, top_k] ids, read when it finishes
        self.grammar: str | None = None  # structured_outputs' compiled grammar key (engine/structured.py)
        self.matcher = None  # this sequence's grammar state, made at its first sampled token

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        return self.num_uncomputed > 1

    def append_token(self, token: int, policy_version: int, weight_version: str = "default") -> None:
        self.token_ids.append(token)
        n = self.num_output_tokens
        spans = self.version_spans
        if spans and spans[-1].policy_version == policy_version and spans[-1].weight_version == weight_version:
            spans[-1].end = n
        else:
            spans.append(VersionSpan(policy_version, n - 1, n, weight_version))

    def output(self) -> CompletionOutput:
        finished = self.status is Status.FINISHED
        return CompletionOutput(
            index=self.index,
            token_ids=self.output_token_ids,
            text=self.detok.visible_text(finished) if self.detok else "",
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            top_logprobs=list(self.top_logprobs) if self.top_logprobs is not None else None,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            version_spans=[VersionSpan(s.policy_version, s.start, s.end, s.weight_version) for s in self.version_spans],
            routed_experts=self.routed_experts,
        )
