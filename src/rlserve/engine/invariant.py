"""Batch-invariant mode (`engine.batch_invariant`): the engine's side.

The model's arithmetic is made per row in `model/invariant_ops.py`. Here the step is laid out so
that every token is a row of its own: prompt tokens attend through the decode kernel like decoded
ones (`token_rows`), the sampler works one row at a time on one thread and computes a token's
logprob by one formula whatever the row's neighbours (`InvariantSampler`), and prompt logprobs use
that formula too (`row_log_softmax`), so re-scoring a finished sequence reproduces the logprobs
generation returned, bit for bit.
"""

from __future__ import annotations

import torch

from rlserve.engine.kv.pool import padded_blocks
from rlserve.engine.sampler import (
    NEG_INF,
    Sampler,
    SampleResult,
    SamplingRow,
    _filter,
    _penalize,
)
from rlserve.model.invariant_ops import BatchInvarianceUnavailable, row_log_softmax
from rlserve.model.llama import AttentionBatch
from rlserve.model.torch_threads import one_torch_thread

__all__ = ["InvariantSampler", "check_supported", "processed_logits", "row_log_softmax", "token_rows"]


def check_supported(config, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse the settings under which a row's bits would still follow its batch."""
    if device.type not in ("cpu", "cuda"):
        raise BatchInvarianceUnavailable(
            f"engine.batch_invariant runs on CPU or CUDA (model.device={device.type}); set model.device or drop it"
        )
    if dtype not in (torch.float32, torch.bfloat16):
        raise BatchInvarianceUnavailable(
            f"engine.batch_invariant runs in float32 or bfloat16, its kernels' dtypes (model.dtype="
            f"{config.model.dtype}); set model.dtype to one of those or auto"
        )
    if config.parallel.tp > 1:
        raise BatchInvarianceUnavailable(
            f"engine.batch_invariant: parallel.tp={config.parallel.tp} is not covered yet (the other ranks keep the "
            "row-count-dependent matmuls); set parallel.tp=1"
        )
    if device.type == "cpu" and not config.engine.cpu_kernels:
        raise BatchInvarianceUnavailable("engine.batch_invariant needs engine.cpu_kernels=true")


def token_rows(attn: AttentionBatch, batch, positions: list[int]) -> AttentionBatch:
    """The step's attention with every token as a decode row: decodes first, then each prefill
    chunk's tokens in order (the runner's row order), each attending to its own positions [0, p].
    A chunk's rows share one table, so the kernel takes them as tiles of consecutive positions.
    (Also the default mode's prefill on AVX-512, dense models on one rank: faster there.)"""
    bs = attn.block_size
    seqs = list(batch.decodes) + [seq for seq, _ in batch.prefills]
    rows_per_seq = [1] * len(batch.decodes) + [n for _, n in batch.prefills]
    lens = [p + 1 for p in positions]
    width = -(-max(lens) // bs)
    tables = torch.tensor([padded_blocks(seq.block_table, width) for seq in seqs])
    if batch.prefills:
        with one_torch_thread():  # a parallel region here cost ~4 ms of a 64-row decode step (its barrier)
            tables = tables.repeat_interleave(torch.tensor(rows_per_seq), dim=0)
    blocks = tables.view(-1)
    device = attn.slot_mapping.device
    return AttentionBatch(
        slot_mapping=attn.slot_mapping,
        num_decode=len(seqs),
        decode_blocks=blocks.to(device),
        decode_mask=None,
        decode_lens=torch.tensor(lens, device=device),
        cascade=None,
        prefills=[],
        block_size=bs,
        lora=attn.lora,
        kernels=attn.kernels,
    )


class InvariantSampler(Sampler):
    """The sampler one row at a time on one thread; a token's logprob (and its top-k) is log_softmax
    of the distribution its row was sampled from (raw or processed), whether the row was greedy or
    not. The row's distribution is processed once, for the draw and the logprobs alike."""

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        # plain rows draw through the C walk, which takes each row alone on one thread (8x faster at 64 rows)
        tokens = self._plain_draw(logits, rows)[0].tolist() if self._walks(logits, rows) else None
        with one_torch_thread():
            results = [
                self._one_row(logits[i : i + 1], row, None if tokens is None else tokens[i])
                for i, row in enumerate(rows)
            ]
        want = any(r.num_logprobs is not None for r in rows)
        return SampleResult(
            [r.token_ids[0] for r in results],
            [None if r.logprobs is None else r.logprobs[0] for r in results] if want else None,  # type: ignore[misc]
            [r.top_logprobs[0] for r in results],
        )

    def _one_row(self, logits: torch.Tensor, row: SamplingRow, token: int | None = None) -> SampleResult:
        """The row's token (drawn here unless the C walk drew it) and its logprobs."""
        if row.forced_id is not None:  # test-only rows keep the general path
            return self._sample(logits.clone(), [row])
        # the processed distribution: to draw from, or for processed logprobs (a drawn row without logprobs skips it)
        processed = processed_logits(logits.clone(), row) if token is None or row.num_logprobs is not None else None
        if token is None:
            token = int(self._draw(processed, [row], [row.temperature == 0])[0][0])
        if row.num_logprobs is None:
            return SampleResult([token], None, [[]])
        dist = logits if row.raw_logprobs else processed
        values = dist if row.as_logits else torch.log_softmax(dist, dim=-1)
        top: list[tuple[int, float]] = []
        if row.num_logprobs:
            best_v, best_i = values[0].topk(min(row.num_logprobs, values.shape[1]))
            top = list(zip(best_i.tolist(), best_v.tolist()))
        return SampleResult([token], [values[0, token].item()], [top])


def processed_logits(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The distribution the sampler draws one row from ([1, vocab], changed in place): bias,
    penalties, bans and the structured-outputs mask, temperature, then top-k / top-p / min-p (the order of `Sampler._sample`)."""
    if row.logit_bias:
        ids = torch.tensor(list(row.logit_bias), device=logits.device)
        logits[0].index_add_(0, ids, torch.tensor(list(row.logit_bias.values()), device=logits.device))
    if row.penalties is not None:
        _penalize(logits[0], *row.penalties)
    if row.banned_ids:
        logits[0, row.banned_ids] = NEG_INF
    if row.allowed is not None:  # structured outputs' mask, as Sampler._sample applies it
        logits[0].masked_fill_(~row.allowed.to(logits.device), NEG_INF)
    if row.temperature not in (0, 1.0):
        logits = logits / row.temperature
    return _filter(logits, [row])
