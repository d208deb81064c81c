"""Batch tensors for one step -> model -> the logits rows the sampler and prompt logprobs need."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlserve.engine.allocator import available_memory_bytes
from rlserve.engine.graphs import DecodeGraphs
from rlserve.engine.invariant import token_rows
from rlserve.engine.kv.pool import padded_blocks
from rlserve.engine.routing import RoutedExpertsPool
from rlserve.engine.scheduler import ScheduledBatch
from rlserve.model.batch import AttentionBatch, CascadePlan, PrefillSeq
from rlserve.model.cpu_kernels import CpuKernels, cpu_kernels
from rlserve.model.invariant_ops import BatchInvarianceUnavailable, invariant_kernels
from rlserve.model.llama import CausalLM
from rlserve.model.lora import LoraAdapter, LoraBatch
from rlserve.model.moe import routed_experts
from rlserve.model.torch_threads import one_torch_thread

if TYPE_CHECKING:
    from rlserve.engine.tp.leader import TensorParallelLeader

log = logging.getLogger(__name__)


@dataclass(slots=True)
class StepLogits:
    sample_logits: torch.Tensor  # [num sampling rows, vocab] fp32
    sample_seqs: list  # the sequence of each sampling row
    # per sequence asking for prompt logprobs: (sequence, first prompt position predicted, logits rows)
    prompt_logits: list[tuple[object, int, torch.Tensor]]


def kv_bytes_per_token(model: CausalLM, dtype: torch.dtype) -> int:
    s = model.shape
    return s.num_layers * 2 * s.num_kv_heads * s.head_dim * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        cascade_attention: bool = True,
        pack_weights: bool = True,
        use_cpu_kernels: bool = True,
        batch_invariant: bool = False,
    ):
        self.model, self.block_size, self.device = model, block_size, device
        self.kernels = self._cpu_kernels(dtype) if use_cpu_kernels and device.type == "cpu" else None
        self.batch_invariant = (
            batch_invariant  # engine/invariant.py: every token its own row, the GEMV at any row count
        )
        if batch_invariant:
            self.kernels = self._invariant_kernels(dtype)
        # The split attention needs the CPU SDPA kernel that returns log-sum-exp. The C attention
        # kernel reads shared blocks from cache for every sequence and is faster still (~10% a
        # step at 64 sequences, n = 8), so the split is only the fallback's.
        self.cascade_attention = cascade_attention and device.type == "cpu" and self.kernels is None
        # prompt tokens attend through the C paged kernel, a chunk's rows as tiles (token_rows), where
        # that was measured faster than torch's flash SDPA: its attention at 1.4-2.6x SDPA's from 256
        # to 4,096 positions; prefill tokens/s at 2,048 and 4,096 positions 1.31x and 1.31x (fp32),
        # 1.57x and 1.36x (bf16) of one row per K/V read up to 2,048 and SDPA past it (SmolLM2-135M
        # shape, 2 cores, AVX-512 + AVX512_BF16, benchmarks/prefill.py); on AVX2, fp32, its 8-lane form at
        # 1.2-1.9x SDPA's attention from 512 to 2,048 positions, prefill 1.03-1.2x up to 2,048 positions and
        # level to 1.2x at 4,096 (docs/cpu-performance.md). Dense models on one rank
        # (`run`; the tp ranks keep SDPA). Not MoE: its router turned the ~1e-6 between the two
        # attentions into expert swaps between a one-rank engine and a tp=2 or data-parallel EP one
        # (tests/test_moe_mini.py), so an MoE prompt takes SDPA at every rank count
        self.prompt_rows_in_kernel = (
            self.kernels is not None
            and self.kernels.prompt_tiles_beat_sdpa(dtype)
            and not batch_invariant
            and model.shape.moe is None
        )
        self.dtype = dtype
        model.use_gemv(self.kernels)  # first: a head that reads its bf16 weight through the GEMV needs no packed copy
        if pack_weights:
            self._pack_weights_if_they_fit()
        s = model.shape
        # [layers, 2, slots, kv_heads, head_dim]; zeros so padded gathers never read NaN garbage.
        # One block more than the pool hands out: the scratch block padded graph rows write to.
        self.scratch_block = num_blocks
        self.kv_cache = torch.zeros(
            s.num_layers, 2, (num_blocks + 1) * block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=device
        )
        self._block_offsets = torch.arange(block_size, device=device)
        self.graphs: DecodeGraphs | None = None
        self.routing: RoutedExpertsPool | None = None  # set by the engine when router replay is on
        self.tp: TensorParallelLeader | None = None  # set by the engine under tensor parallelism (rank 0)

    def _cpu_kernels(self, dtype: torch.dtype) -> CpuKernels | None:
        kernels = cpu_kernels()
        s = self.model.shape
        if kernels is None or not kernels.supports(s.num_heads, s.num_kv_heads, s.head_dim, self.block_size, dtype):
            return None
        return kernels

    def _invariant_kernels(self, dtype: torch.dtype):
        kernels, s = invariant_kernels(self.device.type, dtype), self.model.shape
        if not kernels.supports(s.num_heads, s.num_kv_heads, s.head_dim, self.block_size, dtype):
            raise BatchInvarianceUnavailable(
                f"engine.batch_invariant: the {self.device.type} kernels do not cover this model's attention in {dtype} "
                f"(heads {s.num_heads}/{s.num_kv_heads}, head_dim {s.head_dim}, block_size {self.block_size})"
            )
        return kernels

    def _pack_weights_if_they_fit(self) -> None:
        """Packed copies double the weights' memory: take at most half of what is available, so
        the KV pool and activations still fit."""
        # the C GEMM's panels where they beat the GEMM libraries, and always in batch-invariant mode
        # (its GEMM at any row count: the same bits as unpacked, which is how the trainer's mirror runs)
        panels = self.kernels is not None and (
            self.batch_invariant or self.kernels.panels_beat_the_libraries(self.dtype)
        )
        need = self.model.panel_bytes() if panels else self.model.packable_bytes()
        available = available_memory_bytes()
        if need and available is not None and need > available // 2:
            log.warning(
                "not packing the weights: the packed copies need %.1f GiB and %.1f GiB of memory is "
                "available (set engine.pack_weights=false to silence this)",
                need / 2**30,
                available / 2**30,
            )
            return
        if panels:
            self.model.pack_panels()
        else:
            self.model.pack_weights()

    def use_decode_graphs(self, max_batch: int, max_model_len: int, capture: bool = True) -> None:
        """Run decode-only steps through static-shape forwards, captured as CUDA graphs (`capture`)."""
        max_blocks = -(-max_model_len // self.block_size)
        self.graphs = DecodeGraphs(
            self.model, self.kv_cache, self.block_size, self.scratch_block, max_batch, max_blocks, capture
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, adapters: dict[str, LoraAdapter]) -> StepLogits:
        if batch.block_copies:
            self._copy_blocks(batch.block_copies)
        cascade = None
        if len(batch.decodes) > 1 and self.cascade_attention:
            # rows are reordered for the plan; the batch keeps that order for everything after
            cascade, batch.decodes = self._cascade_plan(batch.decodes)
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        for seq in batch.decodes:
            pos = len(seq.token_ids) - 1
            input_ids.append(seq.token_ids[pos])
            positions.append(pos)
            slots.append(seq.block_table[pos // bs] * bs + pos % bs)
        prefills: list[PrefillSeq] = []
        sample_rows: list[int] = list(range(len(batch.decodes)))
        sample_seqs: list = list(batch.decodes)
        prompt_rows: list[tuple[object, int, int, int]] = []
        for seq, n in batch.prefills:
            start = seq.num_computed_tokens
            q_start = len(input_ids)
            input_ids.extend(seq.token_ids[start : start + n])
            positions.extend(range(start, start + n))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            ctx = start + n
            if start == 0:
                prefills.append(PrefillSeq(q_start, n, ctx, None))
            else:  # built once per step, shared by every layer
                mask = torch.ones(n, ctx, dtype=torch.bool, device=self.device).tril(ctx - n)
                prefills.append(PrefillSeq(q_start, n, ctx, self._context_slots([table], [ctx], ctx), mask))
            if ctx == len(seq.token_ids):
                sample_rows.append(q_start + n - 1)
                sample_seqs.append(seq)
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                last = min(ctx, seq.num_prompt_tokens - 1)  # rows predicting prompt tokens start+1 .. last
                prompt_rows.append((seq, start + 1, q_start, last - start))

        lora = self._lora_batch(batch, adapters) if adapters else None
        decode_blocks = decode_mask = lens = None
        if batch.decodes and cascade is None:
            ctx_lens = [len(s.token_ids) for s in batch.decodes]
            width = -(-max(ctx_lens) // bs)
            key = None if prefills or lora or self.graphs is None else self.graphs.bucket(len(ctx_lens), width)
            if key is not None:
                tables = [s.block_table for s in batch.decodes]
                hidden = self.graphs.forward(key, input_ids, positions, slots, tables)
                return StepLogits(self.model.compute_logits(hidden), sample_seqs, [])
            decode_blocks = torch.tensor(
                [padded_blocks(s.block_table, width) for s in batch.decodes],
                device=self.device,
            ).view(-1)
            lens = torch.tensor(ctx_lens, device=self.device)
            if self.kernels is None:
                positions_ = torch.arange(width * bs, device=self.device)
                decode_mask = (positions_ < lens.unsqueeze(1)).view(len(ctx_lens), 1, 1, width * bs)
        attn = AttentionBatch(
            slot_mapping=torch.tensor(slots, device=self.device),
            num_decode=len(batch.decodes),
            decode_blocks=decode_blocks,
            decode_mask=decode_mask,
            decode_lens=lens,
            cascade=cascade,
            prefills=prefills,
            block_size=bs,
            lora=lora,
            kernels=self.kernels,
        )
        if self.batch_invariant or (prefills and self.prompt_rows_in_kernel and self.tp is None):
            attn = token_rows(attn, batch, positions)
        ids, pos = torch.tensor(input_ids, device=self.device), torch.tensor(positions, device=self.device)
        if self.tp is not None:  # the other ranks run the same step on their shards
            self.tp.send_step(ids, pos, attn, batch.block_copies)
        hidden = self.model(ids, pos, attn, self.kv_cache)
        self._record_routing(attn.slot_mapping)
        sample_logits = self.model.compute_logits(self._rows(hidden, sample_rows)) if sample_rows else None
        prompt_logits = [
            (seq, first, self.model.compute_logits(hidden[q0 : q0 + count])) for seq, first, q0, count in prompt_rows
        ]
        return StepLogits(sample_logits, sample_seqs, prompt_logits)

    def _rows(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if len(rows) == hidden.shape[0] and rows == list(range(len(rows))):  # every row, in order: a decode step
            return hidden
        with one_torch_thread():
            return hidden.index_select(0, torch.tensor(rows, device=self.device))

    def _record_routing(self, slots: torch.Tensor) -> None:
        if self.routing is not None:
            self.routing.record(slots, routed_experts(self.model.layers, slots.shape[0]))

    def _cascade_plan(self, decodes: list) -> tuple[CascadePlan | None, list]:
        """Groups of decoding sequences whose tables start with the same full blocks, and the
        decodes reordered with each group's members together, first; (None, decodes) when no two
        sequences share a block. A block id shared by two tables is full and immutable (the last,
        partial block is copied on write), and a block id always sits at the same index."""
        bs = self.block_size
        by_first: dict[int, list] = {}
        for seq in decodes:
            if len(seq.token_ids) - 1 >= bs:  # at least one full block before the written slot
                by_first.setdefault(seq.block_table[0], []).append(seq)
        groups = [(members, self._shared_blocks(members)) for members in by_first.values() if len(members) > 1]
        if not groups:
            return None, decodes
        in_group = {id(s) for members, _ in groups for s in members}
        ordered = [s for members, _ in groups for s in members] + [s for s in decodes if id(s) not in in_group]
        grouped = len(in_group)
        width = max(len(members) for members, _ in groups)
        query_rows = None
        if any(len(members) != width for members, _ in groups):
            rows, start = [], 0
            for members, _ in groups:
                rows += list(range(start, start + len(members))) + [grouped] * (width - len(members))
                start += len(members)
            query_rows = torch.tensor(rows, device=self.device)
        prefix_width = max(shared for _, shared in groups)
        prefix_blocks = [
            blk for members, shared in groups for blk in padded_blocks(members[0].block_table[:shared], prefix_width)
        ]
        prefix_mask = None
        if any(shared != prefix_width for _, shared in groups):
            valid = torch.arange(prefix_width * bs) < torch.tensor([shared * bs for _, shared in groups]).unsqueeze(1)
            prefix_mask = self._additive(valid).view(len(groups), 1, 1, -1)
        prefix_len = [shared for members, shared in groups for _ in members] + [0] * (len(decodes) - grouped)
        ctx_lens = [len(s.token_ids) for s in ordered]
        own = [-(-c // bs) - p for c, p in zip(ctx_lens, prefix_len)]
        suffix_width = max(own)
        suffix_blocks = [
            blk
            for s, p, n in zip(ordered, prefix_len, own)
            for blk in padded_blocks(s.block_table[p : p + n], suffix_width)
        ]
        start = torch.tensor([p * bs for p in prefix_len]).unsqueeze(1)
        valid = start + torch.arange(suffix_width * bs) < torch.tensor(ctx_lens).unsqueeze(1)
        plan = CascadePlan(
            prefix_blocks=torch.tensor(prefix_blocks, device=self.device),
            prefix_mask=prefix_mask,
            group_width=width,
            num_grouped=grouped,
            query_rows=query_rows,
            suffix_blocks=torch.tensor(suffix_blocks, device=self.device),
            suffix_mask=self._additive(valid).view(len(ordered), 1, 1, -1),
        )
        return plan, ordered

    def _shared_blocks(self, members: list) -> int:
        """Leading blocks common to every member's table, all of them full for every member."""
        shared = min((len(s.token_ids) - 1) // self.block_size for s in members)
        first = members[0].block_table
        for seq in members[1:]:
            table, i = seq.block_table, 1
            while i < shared and table[i] == first[i]:
                i += 1
            shared = i
        return shared

    def _additive(self, valid: torch.Tensor) -> torch.Tensor:
        return torch.zeros(valid.shape, dtype=self.dtype).masked_fill_(~valid, float("-inf")).to(self.device)

    def _lora_batch(self, batch: ScheduledBatch, adapters: dict[str, LoraAdapter]) -> LoraBatch | None:
        rows: dict[str, list[int]] = {}
        for i, seq in enumerate(batch.decodes):
            if seq.request.adapter is not None:
                rows.setdefault(seq.request.adapter, []).append(i)
        start = len(batch.decodes)
        for seq, n in batch.prefills:
            if seq.request.adapter is not None:
                rows.setdefault(seq.request.adapter, []).extend(range(start, start + n))
            start += n
        if not rows:
            return None
        segments = [(adapters[name], torch.tensor(r, device=self.device)) for name, r in rows.items()]
        return LoraBatch(segments, self.model.shape)

    def _context_slots(self, tables: list[list[int]], ctx_lens: list[int], max_ctx: int) -> torch.Tensor:
        """KV slots of positions [0, max_ctx) for each table, flattened; positions past a sequence's
        context point at real slots of its own blocks or block 0 and are masked out."""
        bs = self.block_size
        width = -(-max_ctx // bs)
        blocks = torch.tensor([padded_blocks(t, width) for t in tables], device=self.device)
        slots = (blocks.unsqueeze(2) * bs + self._block_offsets).view(len(tables), -1)[:, :max_ctx]
        return slots.reshape(-1)

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        bs = self.block_size
        src = torch.tensor([s * bs + i for s, _ in copies for i in range(bs)], device=self.device)
        dst = torch.tensor([d * bs + i for _, d in copies for i in range(bs)], device=self.device)
        self.kv_cache.index_copy_(2, dst, self.kv_cache.index_select(2, src))
        if self.routing is not None:
            self.routing.copy(src, dst)
