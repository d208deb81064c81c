"""`token_logprobs`: each completion token's logprob under a (patched) transformers model, one float32
tensor per sequence, computed by the sampler's formula (`row_log_softmax`: each row alone, one thread),
so a patched model's result does not depend on how the sequences are batched.
"""

from __future__ import annotations

import torch
from torch import nn

from rlserve.model.invariant_ops import row_log_softmax
from rlserve.train.patch import FAMILIES, logits_of, segments


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
    device = next(model.parameters()).device
    for start in range(0, len(prompt_ids), batch_size):
        prompts, completions = prompt_ids[start : start + batch_size], completion_ids[start : start + batch_size]
        seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
        ids, mask, pos, starts = _packed(seqs) if packed else _padded(seqs)
        batch = ids.to(device), mask.to(device), pos.to(device), starts
        wanted = [range(len(p) - 1, len(p) - 1 + len(c)) for p, c in zip(prompts, completions)]
        rows = _completion_logits(model, *batch, wanted).split([len(c) for c in completions])
        for logits, c in zip(rows, completions, strict=True):
            if not c:
                out.append(torch.zeros(0, dtype=torch.float32, device=device))
                continue
            targets = torch.tensor(c, device=logits.device).unsqueeze(1)
            out.append(row_log_softmax(logits.float()).gather(1, targets).squeeze(1))
    return out


def _completion_logits(model: nn.Module, input_ids, mask, pos, starts, wanted: list[range]) -> torch.Tensor:
    """The logits of the wanted rows of each sequence, concatenated. The LM head runs on those rows
    only where the model's logits are its head over the decoder's output (a patched model, or a
    family rlserve serves), as TRL's `logits_to_keep` does; other models run their whole forward."""
    if getattr(model, "_rlserve_exact", None) is not None:
        return logits_of(model, input_ids, segments(mask, pos), wanted)
    places = [(row, first + w) for (row, first), positions in zip(starts, wanted) for w in positions]
    rows, cols = torch.tensor(places, dtype=torch.long).reshape(-1, 2).unbind(1)
    if getattr(getattr(model, "config", None), "model_type", None) in FAMILIES:
        hidden = model.get_decoder()(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return model.get_output_embeddings()(hidden.last_hidden_state[rows, cols])
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=pos, use_cache=False).logits
    return logits[rows, cols]


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
