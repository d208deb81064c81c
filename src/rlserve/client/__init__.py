"""rlserve's Python client: OpenAI-style and RL calls over one or several servers, samples with
exact ids/logprobs/versions, training batches, and the trainer-side weight broadcaster."""

from __future__ import annotations

from typing import Any

from rlserve.client.client import InferenceClient
from rlserve.client.errors import (
    AdminError,
    BadRequest,
    ContextLengthExceeded,
    EndpointUnavailable,
    RetryableError,
    RLServeError,
    ServerError,
    StreamInterrupted,
    WeightSyncTimeout,
)
from rlserve.client.sample import Sample, TrainingBatch, build_training_batch, hf_tokenizer, to_nexrl
from rlserve.client.sync import SyncInferenceClient

__all__ = [
    "AdminError",
    "BadRequest",
    "ContextLengthExceeded",
    "EndpointUnavailable",
    "InferenceClient",
    "RetryableError",
    "RLServeError",
    "Sample",
    "ServerError",
    "StreamInterrupted",
    "SyncInferenceClient",
    "TrainingBatch",
    "WeightBroadcaster",
    "WeightSyncTimeout",
    "build_training_batch",
    "hf_tokenizer",
    "to_nexrl",
]


def __getattr__(name: str) -> Any:
    # WeightBroadcaster pulls in torch.distributed: load it only for trainers that ask
    if name == "WeightBroadcaster":
        from rlserve.client.weights import WeightBroadcaster

        return WeightBroadcaster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
