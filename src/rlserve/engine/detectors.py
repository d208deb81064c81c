"""prime-rl's degenerate-rollout detectors ([logits_processors.*] in its inference config).

Both read the model's own distribution (log_softmax of the logits, before temperature, bias or
penalties) at each sampled token:
- gibberish: the token's id > token_id_threshold and its logprob < -log(vocab) - logprob_offset
  (a rare token drawn at high entropy);
- repetition: `window` consecutive tokens each drawn where the top probability > prob_threshold.
When one fires, the next token is EOS, drawn from a one-hot distribution as prime-rl's processors
force it (processed logprob 0), and the sequence finishes with "stop" and stop_reason = the
detector's name. A sequence that reaches max_tokens on the detected token ends with "length".
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from rlserve.config.schema import LogitsProcessorsConfig
from rlserve.engine.sampler import SamplingRow

GIBBERISH, REPETITION = "gibberish_detection", "repetition_detection"


@dataclass(slots=True)
class Probe:
    """One step's facts about each sampling row, taken before the sampler edits the logits."""

    lse: torch.Tensor  # [n] log-sum-exp of the raw logits
    top: torch.Tensor  # [n] the largest raw logit
    logits: torch.Tensor  # the step's logits (rows the sampler edits in place are swapped for copies)
    saved: dict[int, torch.Tensor]


class Detectors:
    def __init__(self, cfg: LogitsProcessorsConfig, vocab_size: int):
        self.gibberish, self.repetition = cfg.gibberish_detection, cfg.repetition_detection
        if self.gibberish is not None:
            self.logprob_floor = -math.log(vocab_size) - self.gibberish.logprob_offset
        if self.repetition is not None:
            self.log_threshold = math.log(self.repetition.prob_threshold)

    @property
    def active(self) -> bool:
        return self.gibberish is not None or self.repetition is not None

    def probe(self, logits: torch.Tensor, rows: list[SamplingRow]) -> Probe:
        edited = {
            i: logits[i].clone()
            for i, r in enumerate(rows)
            if r.logit_bias or r.penalties or r.banned_ids or r.top_p < 1 or r.min_p > 0 or r.forced_id is not None
        }
        return Probe(torch.logsumexp(logits, dim=-1).cpu(), logits.amax(dim=-1).cpu(), logits, edited)

    def check(self, probe: Probe, row: int, seq, token: int) -> str | None:
        """The detector that fires on this sampled token, if any (updates the repetition run)."""
        fired = None
        lse = float(probe.lse[row])
        if self.repetition is not None:
            confident = float(probe.top[row]) - lse > self.log_threshold
            seq.confident_run = seq.confident_run + 1 if confident else 0
            if seq.confident_run >= self.repetition.window:
                fired = REPETITION
        if self.gibberish is not None and token > self.gibberish.token_id_threshold:
            raw = probe.saved.get(row, probe.logits[row])
            if float(raw[token]) - lse < self.logprob_floor:
                fired = GIBBERISH
        return fired
