"""`token_logprobs`: each completion token's logprob under a (patched) transformers model, one float32
tensor per sequence, computed by the sampler's formula (`row_log_softmax`: each row alone, one thread),
so a patched model's result does not depend on how the sequences are batched.
"""

from __future__ import annotations

import torch
from torch import nn

from rlserve.model.invariant_ops import row_log_softmax


def token_logprobs(
    model: nn.Module,
    prompt_ids: list[list[int]],
    completion_ids: list[list[int]],
    *,
    batch_size: int = 16,
    packed: bool = False,
) -> list[torch.Tensor]:
    """One float32 tensor per sequence: logprob of completion_ids[i][j] given the prompt and the
    completion before it. Sequences run `batch_size` at a time, right-padded or (`packed`, a
    patched model only) concatenated into one row; autograd flows when the parameters require it."""
    if len(prompt_ids) != len(completion_ids):
        raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")
    if any(not p for p in prompt_ids):
        raise ValueError("every prompt needs at least one token (the first completion token is predicted from it)")
    if packed and getattr(model, "_rlserve_exact", None) is None:
        raise ValueError("packed=True needs a model made exact by rlserve.train.patch (its forward splits packed rows)")
    out: list[torch.Tensor] = []
    for start in range(0, len(prompt_ids), batch_size):
        prompts, completions = prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size]
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        input_ids, mask, pos, where = _packed(seqs) if packed else _padded(seqs)
        logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
        for (row, first), p, c in zip(where, prompts, completions, strict=True):
            if not c:
                out.append(torch.zeros(0, dtype=torch.float32))
                continue
            rows = logits[row, first + len(p) - 1 : first + len(p) - 1 + len(c)].float()
            targets = torch.tensor(c).unsqueeze(1)
            out.append(row_log_softmax(rows).gather(1, targets).squeeze(1))
    return out


def _padded(seqs: list[list[int]]):
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
    pos = torch.arange(longest).expand(len(seqs), longest).contiguous()
    return ids, mask, pos, [(i, 0) for i in range(len(seqs))]


def _packed(seqs: list[list[int]]):
    ids = torch.tensor([t for s in seqs for t in s]).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0)
    starts, at = [], 0
    for s in seqs:
        starts.append((0, at))
        at += len(s)
    return ids, torch.ones_like(ids), pos, starts


def token_routed_experts(model: nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]]):
    """A patched Qwen3-MoE model's routed experts per sequence, as the server returns them
    (`enable_return_routed_experts`): int64 [prompt + completion - 1 rows, sparse layers, top_k],
    one row per forwarded token (the last completion token is never forwarded)."""
    mirror = getattr(model, "_rlserve_exact", None)
    if mirror is None or mirror.shape.moe is None:
        raise ValueError("token_routed_experts needs a mixture-of-experts model patched by rlserve.train.patch")
    seqs = [(list(p) + list(c))[:-1] for p, c in zip(prompt_ids, completion_ids, strict=True)]
    _, experts = mirror.logits(seqs, want_experts=True)
    return list(experts.long().split([len(s) for s in seqs]))
