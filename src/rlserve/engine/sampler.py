"""From fp32 logits to sampled tokens and their logprobs.

The processed distribution is: min_tokens masking, temperature, then top-k / top-p / min-p with the
kept set renormalised. Sampling is by inverse CDF with one uniform per row drawn from the row's own
generator, so a seeded request samples the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlserve.model.torch_threads import one_torch_thread

if TYPE_CHECKING:
    from rlserve.engine.sequence import Sequence
    from rlserve.model.cpu_kernels import CpuKernels

NEG_INF = float("-inf")
# Below this many logits (two rows of a 50K vocabulary) the CPU ops run on one thread: each op
# over one row takes ~0.1 ms alone, and splitting it opens a parallel region whose barrier waits
# for a descheduled worker when the cores are shared (amax + exp + cumsum of one 49K row: 0.4 ms
# on one thread, 1.2-12 ms on two, 2 loaded cores).
SINGLE_THREAD_LOGITS = 1 << 17


@dataclass(slots=True)
class SamplingRow:
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    generator: torch.Generator | None
    num_logprobs: int | None  # None: no logprobs; k: sampled + k best
    raw_logprobs: bool  # the model's distribution, not the one sampled from
    banned_ids: list[int] | None  # EOS / stop ids masked until min_tokens is reached
    forced_id: int | None = None  # test-only: the processed distribution is one-hot on this token
    logit_bias: dict[int, float] | None = None
    # (repetition, presence, frequency, prompt ids, output ids) when any penalty is active
    penalties: tuple[float, float, float, list[int], list[int]] | None = None
    allowed: torch.Tensor | None = None  # bool [vocab]: structured outputs' mask of the tokens it may take
    as_logits: bool = False  # logprobs_mode *_logits: the values before log_softmax


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None  # per row, the sampled token's logprob (None when no row asked)
    top_logprobs: list[list[tuple[int, float]]]  # per row, the k best (empty when not asked)


class Sampler:
    def __init__(self, generator: torch.Generator, kernels: CpuKernels | None = None):
        self.generator = generator
        # the C walk for plain rows (`_sample_plain`); None: torch ops only (also beside the GPU's Triton kernels)
        self.kernels = kernels if hasattr(kernels, "sample") else None

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        if self._walks(logits, rows):
            return self._sample_plain(logits, rows)
        if logits.device.type != "cpu" or logits.numel() >= SINGLE_THREAD_LOGITS:
            return self._sample(logits, rows)
        with one_torch_thread():
            return self._sample(logits, rows)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        n, device = logits.shape[0], logits.device
        want_logprobs = any(r.num_logprobs is not None for r in rows)
        raw = raw_lse = None  # raw mode: the untouched logits, and what a logprob subtracts from them
        if want_logprobs and any(r.raw_logprobs for r in rows):
            raw = logits.clone()
            as_logits = torch.tensor([r.as_logits for r in rows], device=device).unsqueeze(1)
            raw_lse = self.log_sum_exp(raw).masked_fill(as_logits, 0.0)
        for i, r in enumerate(rows):
            if r.logit_bias:
                ids = torch.tensor(list(r.logit_bias), device=device)
                logits[i].index_add_(
                    0, ids, torch.tensor(list(r.logit_bias.values()), device=device, dtype=logits.dtype)
                )
            if r.penalties is not None:
                _penalize(logits[i], *r.penalties)
            if r.banned_ids:
                logits[i, r.banned_ids] = NEG_INF
            if r.allowed is not None:
                logits[i].masked_fill_(~r.allowed.to(device), NEG_INF)

        greedy = [r.temperature == 0 for r in rows]
        temps = [1.0 if g else r.temperature for g, r in zip(greedy, rows)]
        scaled = logits if all(t == 1.0 for t in temps) else logits / torch.tensor(temps, device=device).unsqueeze(1)
        scaled = _filter(scaled, rows)
        forced = [(i, r.forced_id) for i, r in enumerate(rows) if r.forced_id is not None]
        if forced:
            rows_idx = torch.tensor([i for i, _ in forced], device=device)
            keep = torch.full((len(forced), scaled.shape[1]), NEG_INF, device=device, dtype=scaled.dtype)
            keep[torch.arange(len(forced)), torch.tensor([t for _, t in forced], device=device)] = 0.0
            scaled = scaled.index_copy(0, rows_idx, keep)
        tokens, lse = self._draw(scaled, rows, greedy)
        # logprobs as x - logsumexp(x) (what log_softmax computes), without materialising the
        # full log-distribution
        token_lp: list[float] | None = None
        k = max((r.num_logprobs or 0) for r in rows)
        top: list[list[tuple[int, float]]] = [[] for _ in range(n)]
        if want_logprobs:
            if lse is None:
                lse = torch.logsumexp(scaled, dim=-1, keepdim=True)
            if any(r.as_logits for r in rows):
                lse = lse.masked_fill(torch.tensor([r.as_logits for r in rows], device=device).unsqueeze(1), 0.0)
            lp = scaled.gather(1, tokens.unsqueeze(1)) - lse
            top_v = top_i = None
            if k > 0:
                top_v, top_i = scaled.topk(k, dim=-1)
                top_v = top_v - lse
            if raw is not None:  # raw mode rows read the untouched distribution instead
                pick = torch.tensor([r.raw_logprobs for r in rows], device=device).unsqueeze(1)
                lp = torch.where(pick, raw.gather(1, tokens.unsqueeze(1)) - raw_lse, lp)
                if k > 0:
                    raw_v, raw_i = raw.topk(k, dim=-1)
                    top_v, top_i = torch.where(pick, raw_v - raw_lse, top_v), torch.where(pick, raw_i, top_i)
            token_lp = lp.squeeze(1).tolist()
            if k > 0:
                values, ids = top_v.tolist(), top_i.tolist()
                for i, r in enumerate(rows):
                    if r.num_logprobs:
                        top[i] = list(zip(ids[i][: r.num_logprobs], values[i][: r.num_logprobs]))
        return SampleResult(tokens.tolist(), token_lp, top)

    def _sample_plain(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SampleResult:
        """Rows at temperature 1 or greedy with nothing else to apply: one C walk per row (sample.c)
        for the token and the log-sum-exp. The uniforms come from the same generators, in the same
        order, as `_draw` takes them; the raw and the processed distribution are the same here."""
        tokens, lse, logits = self._plain_draw(logits, rows)
        token_lp = None
        top: list[list[tuple[int, float]]] = [[] for _ in rows]
        if any(r.num_logprobs is not None for r in rows):
            token_lp = (logits.gather(1, tokens.unsqueeze(1)) - lse).squeeze(1).tolist()
            k = max(r.num_logprobs or 0 for r in rows)
            if k > 0:
                top_v, top_i = logits.topk(k, dim=-1)
                values, ids = (top_v - lse).tolist(), top_i.tolist()
                for i, r in enumerate(rows):
                    if r.num_logprobs:
                        top[i] = list(zip(ids[i][: r.num_logprobs], values[i][: r.num_logprobs]))
        return SampleResult(tokens.tolist(), token_lp, top)

    def _walks(self, logits: torch.Tensor, rows: list[SamplingRow]) -> bool:
        """Whether the C walk draws these rows: every row plain, on CPU, with the kernels built, the
        logits not float64 (the walk reads float32)."""
        return self._walk_reads(logits) and all(map(_plain, rows))

    def _walk_reads(self, logits: torch.Tensor) -> bool:
        return self.kernels is not None and logits.device.type == "cpu" and logits.dtype != torch.float64

    def _plain_draw(self, logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor, ...]:
        """The C walk over plain rows: (tokens, log-sum-exps, the fp32 logits it read). Each row is
        walked alone by one thread, so a row's token does not depend on the batch."""
        greedy = [r.temperature == 0 for r in rows]
        u = torch.full((len(rows),), -1.0)
        if not all(greedy):
            u = self._uniforms(rows).masked_fill_(torch.tensor(greedy), -1.0)
        logits = logits.float().contiguous()
        return (*self.kernels.sample(logits, u), logits)

    def _uniforms(self, rows: list[SamplingRow]) -> torch.Tensor:
        """One uniform per row: the unseeded rows' from the engine's generator in one draw, a seeded
        row's from its own, so its draws do not depend on the batch."""
        u = torch.empty(len(rows), dtype=torch.float32)
        unseeded = [i for i, r in enumerate(rows) if r.generator is None]
        if unseeded:
            u[unseeded] = torch.rand(len(unseeded), generator=self.generator)
        for i, r in enumerate(rows):
            if r.generator is not None:
                u[i] = torch.rand(1, generator=r.generator)[0]
        return u

    def log_sum_exp(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, 1]: what log_softmax subtracts from each row, computed as the C walk does where it
        runs, so a raw logprob has the same bits whichever path sampled its token."""
        if not self._walk_reads(logits):
            return torch.logsumexp(logits, dim=-1, keepdim=True)
        return self.kernels.sample(logits.float().contiguous(), torch.full((logits.shape[0],), -1.0))[1]

    def _draw(
        self, scaled: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled tokens, and each row's log-sum-exp [n, 1] when it came for free (else None)."""
        if all(greedy):
            return scaled.argmax(dim=-1), None
        # an unnormalised CDF: u is scaled by its total instead of dividing every probability, and
        # on CPU the total also gives the log-sum-exp the logprobs need (cumsum accumulates in double
        # there; CUDA's accumulates in float, so it computes logsumexp separately)
        top = scaled.amax(dim=-1, keepdim=True)
        cdf = (scaled - top).exp_().cumsum_(dim=-1)
        total = cdf[:, -1:]
        lse = total.log() + top if scaled.device.type == "cpu" else None
        u = self._uniforms(rows).to(scaled.device) * total.squeeze(1)
        tokens = torch.searchsorted(cdf, u.unsqueeze(1), right=True).squeeze(1).clamp_(max=scaled.shape[1] - 1)
        # rounding at the top of the CDF could land on a masked token: fall back to the mode
        masked = scaled.gather(1, tokens.unsqueeze(1)).squeeze(1) == NEG_INF
        if any(greedy) or bool(masked.any()):
            use_argmax = torch.tensor(greedy, device=scaled.device) | masked
            tokens = torch.where(use_argmax, scaled.argmax(dim=-1), tokens)
        return tokens, lse


def _plain(r: SamplingRow) -> bool:
    """Nothing to apply to the row's logits but a draw at temperature 1 (or argmax)."""
    return (
        r.temperature in (0.0, 1.0)
        and r.top_k <= 0
        and r.top_p >= 1.0
        and r.min_p <= 0.0
        and not r.as_logits
        and r.forced_id is None
        and not r.logit_bias
        and r.penalties is None
        and not r.banned_ids
        and r.allowed is None
    )


def _penalize(
    row: torch.Tensor,
    repetition: float,
    presence: float,
    frequency: float,
    prompt_ids: list[int],
    output_ids: list[int],
) -> None:
    """vLLM's penalties, in place on one row of logits."""
    device = row.device
    if repetition != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=device)
        vals = row.index_select(0, seen)
        row.index_copy_(0, seen, torch.where(vals > 0, vals / repetition, vals * repetition))
    if output_ids and (presence or frequency):
        counts = torch.zeros_like(row).index_add_(
            0, torch.tensor(output_ids, device=device), torch.ones(len(output_ids), device=device, dtype=row.dtype)
        )
        row -= frequency * counts + presence * (counts > 0).to(row.dtype)


def _filter(scaled: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Top-k, then top-p, then min-p, each only on the rows that ask for it."""
    device = scaled.device
    ks = [r.top_k if r.top_k > 0 else 0 for r in rows]
    if any(ks):
        kmax = min(max(ks), scaled.shape[1])
        kth = scaled.topk(kmax, dim=-1).values
        idx = torch.tensor([min(k, kmax) - 1 if k else 0 for k in ks], device=device)
        thresh = kth.gather(1, idx.unsqueeze(1))
        active = torch.tensor([k > 0 for k in ks], device=device).unsqueeze(1)
        scaled = scaled.masked_fill(active & (scaled < thresh), NEG_INF)
    p_rows = [i for i, r in enumerate(rows) if r.top_p < 1.0]
    if p_rows:
        sub = scaled[p_rows]
        sorted_logits, order = sub.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        top_p = torch.tensor([rows[i].top_p for i in p_rows], device=device).unsqueeze(1)
        drop_sorted = before >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        scaled[p_rows] = sub.masked_fill(drop, NEG_INF)
    m_rows = [i for i, r in enumerate(rows) if r.min_p > 0]
    if m_rows:
        sub = scaled[m_rows]
        probs = sub.softmax(dim=-1)
        min_p = torch.tensor([rows[i].min_p for i in m_rows], device=device).unsqueeze(1)
        scaled[m_rows] = sub.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, NEG_INF)
    return scaled


def sampling_row(
    seq: Sequence, eos_token_ids: frozenset[int], logprobs_mode: str, detector_eos: int | None
) -> SamplingRow:
    """What the sampler needs for one sequence's next token: its params, bans (min_tokens), forced tokens."""
    p = seq.params
    banned = None
    if seq.num_output_tokens < p.min_tokens:
        banned = list(eos_token_ids) + list(p.stop_token_ids)
    mode = p.logprobs_mode or logprobs_mode  # one of params.LOGPROBS_MODES
    forced = p.forced_token_ids
    forced_id = forced[seq.num_output_tokens] if forced and seq.num_output_tokens < len(forced) else None
    if seq.detected is not None:  # a detector fired on the last token: EOS, one-hot, as prime-rl forces it
        forced_id = detector_eos
    return SamplingRow(
        temperature=p.temperature,
        top_k=p.top_k,
        top_p=p.top_p,
        min_p=p.min_p,
        generator=seq.generator,
        num_logprobs=p.logprobs,
        raw_logprobs=mode.startswith("raw"),
        as_logits=mode.endswith("logits"),
        banned_ids=banned,
        forced_id=forced_id,
        logit_bias=p.logit_bias,
        penalties=(
            (
                p.repetition_penalty,
                p.presence_penalty,
                p.frequency_penalty,
                seq.request.prompt_token_ids,
                seq.output_token_ids,
            )
            if p.penalized
            else None
        ),
    )
