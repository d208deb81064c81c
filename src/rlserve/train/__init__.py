"""The trainer's side of true on-policy RL: a transformers model whose forward computes, bit for bit,
the logprobs rlserve's batch-invariant mode samples with (`patch`, `token_logprobs`).

Its own layer: it imports `config` and `model` (the one model definition it shares with the engine)
and nothing above them; nothing in rlserve imports it.
"""

from rlserve.train.logprobs import token_logprobs, token_routed_experts
from rlserve.train.patch import PatchRefused, patch, unpatch

__all__ = ["PatchRefused", "patch", "token_logprobs", "token_routed_experts", "unpatch"]
