"""What a rollout yields and what a trainer eats: `Sample`, padded training batches, NexRL dicts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass
class Sample:
    """One completion with everything a policy-gradient loss needs.

    `logprobs[i]` is the sampling logprob of `completion_ids[i]`; `weight_versions` are the server's
    half-open spans `{"policy_version", "start", "end", "version"}` over completion indices (several
    when an update landed mid-generation). `message` is the parsed assistant message of chat calls.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    text: str
    finish_reason: str
    policy_version: int | None
    weight_versions: list[dict[str, Any]] = field(default_factory=list)
    message: dict[str, Any] | None = None
    endpoint: str = ""  # the base URL that served it
    step_id: Any = None  # the caller's step_id, echoed (MLX client)
    request_id: str | None = None

    def __getitem__(self, key: str) -> Any:
        """result["text"], as the MLX client's dict answers are read."""
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    @property
    def mixed_versions(self) -> bool:
        return len({s["policy_version"] for s in self.weight_versions}) > 1

    def token_policy_versions(self) -> list[int]:
        """The policy version that produced each completion token (-1 where unknown)."""
        versions = [-1 if self.policy_version is None else self.policy_version] * len(self.completion_ids)
        for span in self.weight_versions:
            for i in range(span["start"], min(span["end"], len(versions))):
                versions[i] = span["policy_version"]
        return versions

    @classmethod
    def from_choice(cls, choice: dict[str, Any], prompt_ids: list[int], text: str, endpoint: str) -> Sample:
        content = (choice.get("logprobs") or {}).get("content") or []
        return cls(
            prompt_ids=list(prompt_ids),
            completion_ids=list(choice.get("token_ids") or []),
            logprobs=[float(e["logprob"]) for e in content],
            text=text,
            finish_reason=choice.get("finish_reason") or "",
            policy_version=choice.get("policy_version"),
            weight_versions=list(choice.get("weight_versions") or []),
            message=choice.get("message"),
            endpoint=endpoint,
        )

    @classmethod
    def overflow(cls, endpoint: str = "") -> Sample:
        """What on_overflow="truncate_sample" returns for a prompt over the context: nothing to train on."""
        return cls([], [], [], "", "length", None, endpoint=endpoint)


@dataclass
class TrainingBatch:
    """Right-padded [batch, time] tensors. `logprobs[b, t]` scores `input_ids[b, t]` (0 on prompt and
    padding), so with logits from `input_ids` compare `logits[:, :-1]` gathered at `input_ids[:, 1:]`
    against `logprobs[:, 1:]` under `loss_mask[:, 1:]`."""

    input_ids: torch.Tensor  # int64: prompt + completion, pad_id after
    attention_mask: torch.Tensor  # int64: 1 on real tokens
    loss_mask: torch.Tensor  # float32: 1 on completion tokens, 0 on prompt and padding
    logprobs: torch.Tensor  # float32: sampling logprobs at completion positions
    token_policy_versions: torch.Tensor  # int64: version per completion token, -1 elsewhere
    policy_versions: torch.Tensor  # int64 [batch]: version of each sample's last token, -1 if none
    prompt_lengths: torch.Tensor  # int64 [batch]
    lengths: torch.Tensor  # int64 [batch]: prompt + completion


def build_training_batch(samples: list[Sample], pad_id: int = 0) -> TrainingBatch:
    import torch  # here, not at import: the client itself needs no torch

    if not samples:
        raise ValueError("build_training_batch needs at least one sample")
    for i, s in enumerate(samples):
        if len(s.logprobs) != len(s.completion_ids):
            raise ValueError(f"sample {i} has {len(s.completion_ids)} completion ids but {len(s.logprobs)} logprobs")
    lengths = [len(s.prompt_ids) + len(s.completion_ids) for s in samples]
    shape = (len(samples), max(max(lengths), 1))
    input_ids = torch.full(shape, pad_id, dtype=torch.int64)
    attention_mask = torch.zeros(shape, dtype=torch.int64)
    loss_mask = torch.zeros(shape, dtype=torch.float32)
    logprobs = torch.zeros(shape, dtype=torch.float32)
    token_versions = torch.full(shape, -1, dtype=torch.int64)
    for b, s in enumerate(samples):
        p, n = len(s.prompt_ids), lengths[b]
        input_ids[b, :n] = torch.tensor(s.prompt_ids + s.completion_ids, dtype=torch.int64)
        attention_mask[b, :n] = 1
        loss_mask[b, p:n] = 1.0
        logprobs[b, p:n] = torch.tensor(s.logprobs, dtype=torch.float32)
        token_versions[b, p:n] = torch.tensor(s.token_policy_versions(), dtype=torch.int64)
    return TrainingBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        loss_mask=loss_mask,
        logprobs=logprobs,
        token_policy_versions=token_versions,
        policy_versions=torch.tensor([-1 if s.policy_version is None else s.policy_version for s in samples]),
        prompt_lengths=torch.tensor([len(s.prompt_ids) for s in samples]),
        lengths=torch.tensor(lengths),
    )


def to_nexrl(samples: list[Sample]) -> dict[str, list]:
    """NexRL's trajectory token fields, one entry per sample."""
    return {
        "prompt_tokens": [list(s.prompt_ids) for s in samples],
        "response_tokens": [list(s.completion_ids) for s in samples],
        "response_logprobs": [list(s.logprobs) for s in samples],
    }


def hf_tokenizer(path: str) -> Any:
    """The model's Hugging Face tokenizer, padding with EOS when it names no pad token."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
