"""Per-request sampling parameters, validated once at the engine boundary."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

# vLLM's four names: raw = the model's distribution before any processing, processed = the one sampled from
# (after bias, penalties, temperature, top-k/top-p/min-p); *_logits return the values before log_softmax
LogprobsMode = Literal["raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits"]
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")
LOGPROBS_MODE_ALIASES = {"raw": "raw_logprobs", "processed": "processed_logprobs"}  # rlserve's older names


def logprobs_mode_name(value: str) -> str:
    """One of LOGPROBS_MODES, for any accepted spelling; ValueError otherwise."""
    name = LOGPROBS_MODE_ALIASES.get(value, value)
    if name not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {value!r}")
    return name


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # 0 and -1 both mean "off" (TRL sends 0)
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output
    presence_penalty: float = 0.0  # subtracted once from tokens already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    logit_bias: dict[int, float] | None = None  # added to the logits before anything else
    seed: int | None = None
    max_tokens: int | None = None  # None: up to the end of the context
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; k >= 0: sampled token plus k best
    prompt_logprobs: int | None = None  # k >= 0, or -1 for the whole vocabulary
    logprobs_mode: LogprobsMode | None = None  # None: the engine's default
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    detokenize: bool = True
    # test-only: the first completion tokens, emitted as if sampled from a one-hot distribution
    # (the server accepts it only with engine.allow_forced_tokens; random-weight models never
    # produce tool calls or reasoning tags on their own)
    forced_token_ids: list[int] | None = None
    # prefill/decode disaggregation (docs/protocols.md §1.2): do_remote_decode on the prefill side,
    # do_remote_prefill plus where the KV is on the decode side; engine/kv/transfer.py reads it
    kv_transfer_params: dict[str, Any] | None = None
    # constrained decoding (engine/structured.py): vLLM's StructuredOutputsParams as a dict, one of
    # json, json_object, regex, choice, grammar, structural_tag; and a whitelist of token ids
    structured_outputs: dict[str, Any] | None = None
    allowed_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"{name} {why}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", f"must be an integer >= 1, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad("temperature", f"must be >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise bad("top_k", f"must be -1 or 0 (off) or a positive integer, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise bad(name, f"must be in [-2, 2], got {value!r}")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or not all(isinstance(k, int) and k >= 0 and _is_number(v) for k, v in self.logit_bias.items())
        ):
            raise bad("logit_bias", f"must map token ids to numbers, got {self.logit_bias!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", f"must be an integer, got {self.seed!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", f"must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad("stop_token_ids", f"must be a list of token ids, got {self.stop_token_ids!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", f"must be null or an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not isinstance(self.prompt_logprobs, int) or self.prompt_logprobs < -1
        ):
            raise bad("prompt_logprobs", f"must be null, -1 or an integer >= 0, got {self.prompt_logprobs!r}")
        if self.forced_token_ids is not None and (
            not isinstance(self.forced_token_ids, list)
            or not all(isinstance(t, int) and t >= 0 for t in self.forced_token_ids)
        ):
            raise bad("forced_token_ids", f"must be a list of token ids, got {self.forced_token_ids!r}")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", f"must be null or an object, got {self.kv_transfer_params!r}")
        if self.logprobs_mode is not None:
            self.logprobs_mode = logprobs_mode_name(self.logprobs_mode)

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def top_k_active(self) -> bool:
        return self.top_k > 0


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
