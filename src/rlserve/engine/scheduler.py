"""Which sequences run in the next step, and with how many tokens.

Decodes go first (one token each), then running prefills continue, then waiting sequences are
admitted, all under one token budget (chunked prefill). When a decode needs a block and none is
free, the most recently admitted sequence is preempted: its blocks are freed and it is recomputed
later (its cached prefix blocks usually survive in the prefix cache).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from rlserve.engine.kv.offload import KVOffload
from rlserve.engine.kv.pool import BlockPool, block_hash
from rlserve.engine.sequence import Request, Sequence, Status
from rlserve.engine.stats import ITERATION_TOKENS_BUCKETS


@dataclass(slots=True)
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, tokens this step)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)


@dataclass(slots=True)
class SchedulerStats:
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of which served from cache
    prompt_tokens_computed: int = 0  # tokens actually run through the model while prefilling
    num_steps: int = 0  # engine steps that ran a batch
    # tokens per step that ran a batch: counts per ITERATION_TOKENS_BUCKETS bound (not cumulative), and their sum
    iteration_tokens: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKENS_BUCKETS) + 1))
    iteration_tokens_sum: int = 0


class Scheduler:
    def __init__(
        self,
        pool: BlockPool,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        cache_key: Callable[[Request], bytes],
    ):
        self.pool = pool
        self.cache_key = cache_key  # extra prefix-cache key of a request under the current weights
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = SchedulerStats()
        self.hold_new = False  # set while draining for a `wait` pause
        self.offload: KVOffload | None = None  # tiers a prefix falls through to after missing the pool
        self.batch_window_s = 0.0  # engine.batch_window_ms
        self.clock: Callable[[], float] = time.monotonic  # the clock of Request.arrival_time

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def admission_delay(self) -> float:
        """Seconds the batch-forming window still holds the waiting requests back (0 = admit now). It only
        holds an idle engine: nothing running, and fewer than max_num_seqs sequences waiting."""
        if self.batch_window_s <= 0 or self.running or not self.waiting or len(self.waiting) >= self.max_num_seqs:
            return 0.0
        first = self.waiting[0].request
        if first.started:  # preempted work waits for nobody
            return 0.0
        return max(0.0, first.arrival_time + self.batch_window_s - self.clock())

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        if self.admission_delay() > 0:
            return batch
        budget = self.max_num_batched_tokens
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted earlier in this loop
            if seq.is_prefill:
                n = min(seq.num_uncomputed, budget)
                batch.prefills.append((seq, n))
                budget -= n
            elif self._reserve_slot(seq, batch):
                batch.decodes.append(seq)
                budget -= 1
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            if self.hold_new and not seq.request.started:
                continue  # draining for a pause: only requests already in flight go on
            if not self._admit(seq):
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            if not seq.request.started:
                seq.request.queue_seconds = time.monotonic() - seq.request.arrival_time
            seq.request.started = True
            self.running.append(seq)
            n = min(seq.num_uncomputed, budget)
            batch.prefills.append((seq, n))
            budget -= n
        if not batch.empty:
            self.stats.iteration_tokens[bisect.bisect_left(ITERATION_TOKENS_BUCKETS, batch.num_tokens)] += 1
            self.stats.iteration_tokens_sum += batch.num_tokens
        return batch

    def num_in_flight(self) -> int:
        """Sequences admitted at least once and not finished (what a `wait` pause waits for)."""
        return len(self.running) + sum(1 for s in self.waiting if s.request.started)

    def _reserve_slot(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Make the block that will hold this decode's KV writable; preempt others if needed."""
        index = (len(seq.token_ids) - 1) // self.block_size
        needs_new = index == len(seq.block_table)
        shared = not needs_new and self.pool.ref_counts[seq.block_table[index]] > 1
        if not needs_new and not shared:
            return True
        while self.pool.num_free == 0:
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
            if victim in batch.decodes:
                batch.decodes.remove(victim)
            batch.prefills = [(s, n) for s, n in batch.prefills if s is not victim]
        block = self.pool.allocate()
        if needs_new:
            seq.block_table.append(block)
        else:  # a forked sibling writing into the shared partial block: copy it first
            old = seq.block_table[index]
            batch.block_copies.append((old, block))
            seq.block_table[index] = block
            self.pool.release(old)
        return True

    def _admit(self, seq: Sequence) -> bool:
        bs, tokens = self.block_size, seq.token_ids
        seq.extra_key = self.cache_key(seq.request)
        hits: list[tuple[int, bytes]] = []
        in_tiers: list[bytes] = []  # hashes of the blocks after the pool hits that an offload tier holds
        tiers: list[str | None] = []  # where each block looked up in the tiers was found
        if self.pool.enable_caching and seq.params.prompt_logprobs is None:
            parent = None
            # leave at least one token to compute: its logits give the next token
            for i in range((len(tokens) - 1) // bs):
                h = block_hash(parent, tokens[i * bs : (i + 1) * bs], seq.extra_key)
                block = None if in_tiers else self.pool.lookup(h)
                if block is not None:
                    hits.append((block, h))
                elif self.offload is None:
                    break
                else:
                    tiers.append(self.offload.where(h))
                    if tiers[-1] is None:
                        break
                    in_tiers.append(h)
                parent = h
        needed = -(-len(tokens) // bs) - len(hits)
        revived = sum(1 for b, _ in hits if self.pool.is_free(b))
        if self.pool.num_free < needed + revived:
            return False
        for b, _ in hits:
            self.pool.take(b)
        for b in reversed(seq.request.held_blocks):  # pulled KV (P/D): the hits above reference it now
            self.pool.release(b)
        seq.request.held_blocks.clear()
        seq.block_table = [b for b, _ in hits] + [self.pool.allocate() for _ in range(needed)]
        seq.block_hashes = [h for _, h in hits]
        if tiers:
            self.offload.count_queries(tiers)
        for h, block in zip(in_tiers, seq.block_table[len(hits) :]):
            if not self.offload.load(h, block):
                break  # gone or corrupt: recompute from here
            self.pool.register(block, h)
            seq.block_hashes.append(h)
        seq.num_computed_tokens = len(seq.block_hashes) * bs
        if seq.num_output_tokens == 0 and seq.index == 0:
            self.stats.prefix_cache_queries += len(tokens)
            self.stats.prefix_cache_hits += len(hits) * bs
            seq.request.num_cached_tokens = seq.num_computed_tokens
        return True

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """The child shares every block of the parent's computed prompt."""
        for b in parent.block_table:
            self.pool.take(b)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.extra_key = parent.extra_key
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = Status.RUNNING
        self.running.append(child)

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Put the sequence's newly completed blocks into the prefix cache."""
        bs = self.block_size
        full = seq.num_computed_tokens // bs
        for i in range(len(seq.block_hashes), full):
            parent = seq.block_hashes[-1] if seq.block_hashes else None
            h = block_hash(parent, seq.token_ids[i * bs : (i + 1) * bs], seq.extra_key)
            seq.block_hashes.append(h)
            self.pool.register(seq.block_table[i], h)

    def preempt(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.stats.num_preemptions += 1

    def finish(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    def _free_blocks(self, seq: Sequence) -> None:
        # tail first, so a shared prefix stays cached longest
        for b in reversed(seq.block_table):
            self.pool.release(b)
        seq.block_table = []
        seq.block_hashes = []
