"""The keys vLLM 0.32 always sends on its OpenAI routes, null or empty where rlserve has nothing to put there,
so clients that parse answers with vLLM's or OpenAI's models see every key (tests/test_vllm_conformance.py
replays vLLM's recorded answers and compares the keys at every level)."""

from __future__ import annotations

import importlib.metadata
import time
import uuid
from typing import Any

# one per server process, as vLLM's "vllm-<version>-<hash>"
SYSTEM_FINGERPRINT = f"rlserve-{importlib.metadata.version('rlserve')}-{uuid.uuid4().hex[:8]}"

# per choice, besides index/text/logprobs/finish_reason/stop_reason
COMPLETION_CHOICE = {"token_ids": None, "prompt_logprobs": None, "prompt_token_ids": None, "routed_experts": None}
CHAT_CHOICE = {"token_ids": None, "routed_experts": None}
CHAT_MESSAGE = {"refusal": None, "annotations": None, "audio": None, "function_call": None}
# per answer, besides id/object/created/model/choices/usage
RESPONSE = {"service_tier": None, "system_fingerprint": SYSTEM_FINGERPRINT, "ec_transfer_params": None, "metrics": None}
CHAT_RESPONSE = {**RESPONSE, "prompt_logprobs": None, "prompt_token_ids": None, "prompt_text": None}


def stream_usage(usage: dict[str, Any], details: bool) -> dict[str, Any]:
    """vLLM's streamed usage: the counts; completion_tokens_details where `details` (chat's continuous
    usage, null when empty), elsewhere only when it holds something."""
    result = {k: usage[k] for k in ("prompt_tokens", "total_tokens", "completion_tokens")}
    details_value = usage.get("completion_tokens_details")
    if details or details_value is not None:
        result["completion_tokens_details"] = details_value
    return result


def stream_metrics(run: Any) -> dict[str, Any]:
    """The usage chunk's `metrics` (a streaming.Run's per-request timing), its unknown fields left out as
    vLLM leaves them; nothing when the request gets none."""
    metrics = run.request_metrics()
    return {} if metrics is None else {"metrics": {k: v for k, v in metrics.items() if v is not None}}


def model_permission() -> dict[str, Any]:
    """The one entry vLLM lists in a model card's `permission`."""
    return {
        "id": f"modelperm-{uuid.uuid4().hex[:16]}",
        "object": "model_permission",
        "created": int(time.time()),
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
