"""Decode steps replayed as CUDA graphs.

A decode step of a small model is hundreds of short kernels whose launch cost exceeds their run
time; a captured graph launches them all at once. Graphs need fixed shapes and fixed addresses, so
a decode batch is padded up to a bucket of (sequences, KV blocks per sequence) and its inputs are
copied into static buffers that every graph reads. Padding rows write their K/V into a scratch
block no sequence owns and attend to it alone. Graphs are captured the first time a bucket is
used and share one memory pool (only one replays at a time, and each output is consumed before
the next replay).

Mixed steps (prefill chunks), LoRA rows and buckets over the gather budget run eagerly.
"""

from __future__ import annotations

import torch

from rlserve.engine.kv.pool import padded_blocks
from rlserve.model.batch import AttentionBatch
from rlserve.model.llama import CausalLM

# Sequences per graph: every size up to 8, then steps of 16 (padding wastes at most 15 rows).
SMALL_BATCHES = (1, 2, 4, 8)
BATCH_STEP = 16
# Most K/V token positions one graph gathers per layer (padded sequences x padded context): bounds
# the memory its pool keeps (for a Qwen3-0.6B in bf16, 4 KiB a position, 512 MiB).
MAX_GATHERED_TOKENS = 1 << 17


def batch_bucket(n: int) -> int:
    for size in SMALL_BATCHES:
        if n <= size:
            return size
    return -(-n // BATCH_STEP) * BATCH_STEP


def width_bucket(blocks: int) -> int:
    """Blocks per sequence, rounded up to a power of two: few graphs, at most 2x the gather."""
    return 1 << max(0, blocks - 1).bit_length()


class DecodeGraphs:
    """Static-shape decode forwards, captured on CUDA; `capture=False` runs the very same padded
    forward eagerly (how the CPU tests check padding, buckets and the scratch block)."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: torch.Tensor,
        block_size: int,
        scratch_block: int,
        max_batch: int,
        max_blocks: int,
        capture: bool,
    ):
        self.model, self.kv_cache, self.block_size = model, kv_cache, block_size
        self.scratch_block, self.capture = scratch_block, capture
        self.max_batch = batch_bucket(max_batch)
        self.max_width = width_bucket(max_blocks)
        device = kv_cache.device
        self.input_ids = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(self.max_batch, dtype=torch.long, device=device)
        self.context_lens = torch.ones(self.max_batch, dtype=torch.long, device=device)
        self.blocks = torch.zeros(self.max_batch * self.max_width, dtype=torch.long, device=device)
        self.offsets = torch.arange(self.max_width * block_size, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def bucket(self, num_seqs: int, max_blocks: int) -> tuple[int, int] | None:
        """The (sequences, blocks) graph a batch runs in; None when it must run eagerly."""
        b, w = batch_bucket(num_seqs), width_bucket(max_blocks)
        if b > self.max_batch or w > self.max_width or b * w * self.block_size > MAX_GATHERED_TOKENS:
            return None
        return b, w

    def forward(
        self,
        key: tuple[int, int],
        input_ids: list[int],
        positions: list[int],
        slots: list[int],
        tables: list[list[int]],
    ) -> torch.Tensor:
        """Hidden states [len(input_ids), hidden] of a decode-only batch, through the key's graph."""
        b, w = key
        n, pad = len(input_ids), b - len(input_ids)
        bs, scratch = self.block_size, self.scratch_block
        rows = [padded_blocks(table, w) for table in tables] + [[scratch] * w] * pad
        host = torch.tensor(
            [
                input_ids + [0] * pad,
                positions + [0] * pad,
                slots + [scratch * bs] * pad,
                [p + 1 for p in positions] + [1] * pad,
            ]
        )
        self.input_ids[:b].copy_(host[0], non_blocking=True)
        self.positions[:b].copy_(host[1], non_blocking=True)
        self.slot_mapping[:b].copy_(host[2], non_blocking=True)
        self.context_lens[:b].copy_(host[3], non_blocking=True)
        self.blocks[: b * w].copy_(torch.tensor(rows).view(-1), non_blocking=True)
        if not self.capture:
            return self._forward(b, w)[:n]
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, w)
        graph, hidden = self.graphs[key]
        graph.replay()
        return hidden[:n]

    def _forward(self, b: int, w: int) -> torch.Tensor:
        span = w * self.block_size
        mask = (self.offsets[:span] < self.context_lens[:b].unsqueeze(1)).view(b, 1, 1, span)
        attn = AttentionBatch(
            slot_mapping=self.slot_mapping[:b],
            num_decode=b,
            decode_blocks=self.blocks[: b * w],
            decode_mask=mask,
            decode_lens=self.context_lens[:b],
            cascade=None,
            prefills=[],
            block_size=self.block_size,
        )
        return self.model(self.input_ids[:b], self.positions[:b], attn, self.kv_cache)

    def _capture(self, b: int, w: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # one eager run first: lazy initialisation (cuBLAS handles, kernel selection) must not
        # happen inside the capture
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(b, w)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            hidden = self._forward(b, w)
        return graph, hidden
