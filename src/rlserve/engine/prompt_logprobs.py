"""Prompt logprobs (the prompt_logprobs sampling field): each prompt token's logprob and rank under the model,
with the top-k alternatives, recorded on the request as its prefill chunks are computed."""

from __future__ import annotations

import torch

from rlserve.engine.invariant import row_log_softmax
from rlserve.engine.sequence import Request


def record_prompt_logprobs(req: Request, first: int, logits: torch.Tensor, batch_invariant: bool = False) -> None:
    k = req.params.prompt_logprobs
    lp = row_log_softmax(logits) if batch_invariant else torch.log_softmax(logits, dim=-1)
    actual = torch.tensor(req.prompt_token_ids[first : first + lp.shape[0]], device=lp.device)
    actual_lp = lp.gather(1, actual.unsqueeze(1)).squeeze(1)
    ranks = (lp > actual_lp.unsqueeze(1)).sum(dim=1) + 1
    width = lp.shape[1] if k == -1 else k
    top_v, top_i = lp.topk(width, dim=-1) if width else (lp[:, :0], lp[:, :0].long())
    for j, (t, v, r) in enumerate(zip(actual.tolist(), actual_lp.tolist(), ranks.tolist())):
        entry = {t: v}
        entry_ranks = {t: r}
        for rank, (i, val) in enumerate(zip(top_i[j].tolist(), top_v[j].tolist()), start=1):
            entry.setdefault(i, val)
            entry_ranks.setdefault(i, rank)
        req.prompt_logprobs[first + j] = entry
        req.prompt_logprob_ranks[first + j] = entry_ranks
