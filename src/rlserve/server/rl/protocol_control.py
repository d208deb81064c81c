"""Bodies of the control routes (docs/protocols.md §2.11). Fields the routes require are checked there,
so a missing one gets the route's own message; here they are typed and documented."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from rlserve.server.protocol import Body

Label = str | int  # weight_version labels: trainers send step numbers too
MAX_RANK = 2**31 - 2  # torch.distributed's ranks and world sizes are int32 (the trainer is one more)
MAX_RENDEZVOUS_S = 86_400.0
INFLIGHT_DESCRIPTION = (
    "what the requests in flight do at this update (default: the server's engine.inflight_update_policy): keep, "
    "recompute (their KV recomputed with the new weights first), abort (they end with their tokens), "
    "recompute_if_older_than:N"
)


def inflight_field() -> Any:
    return Field(
        None, pattern=r"^(keep|recompute|abort|recompute_if_older_than:\d+)$", description=INFLIGHT_DESCRIPTION
    )


class UpdateWeightsRequest(Body):
    """prime-rl `{"weight_dir"}` (null = receive a trainer push), NexRL `{"weight_path"}`, vLLM `update_info`."""

    weight_dir: str | None = None
    weight_path: str | None = None
    model_name: str | None = None
    weight_type: str | None = None
    weight_version: Label | None = None
    update_info: dict[str, Any] | None = None
    inflight_update_policy: str | None = inflight_field()


class FinishWeightUpdateRequest(Body):
    """vLLM's commit point; the in-flight policy may come here or with any /update_weights of the update."""

    weight_version: Label | None = None
    inflight_update_policy: str | None = inflight_field()


class InitBroadcasterRequest(Body):
    host: str | None = None
    port: int | None = Field(None, ge=0, le=65535)
    rank_offset: int = Field(0, ge=0, le=MAX_RANK)
    inference_world_size: int = Field(1, ge=1, le=MAX_RANK)
    timeout: float = Field(300.0, gt=0, le=MAX_RENDEZVOUS_S)
    quantize_in_weight_transfer: bool = False
    session_id: str = "default"


class AbortRequestsRequest(Body):
    request_ids: list[str | int] | None = None


class LoraAdapterRequest(Body):
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False


class UnloadLoraAdapterRequest(Body):
    lora_name: str | None = None


class LoadAdapterRequest(Body):
    adapter_path: str | None = None


class UpdateWeightVersionRequest(Body):
    new_version: Label | None = None
    weight_version: Label | None = None
    abort_all_requests: bool = False


class UpdateWeightsFromDiskRequest(Body):
    model_path: str | None = None
    weight_version: Label | None = None
    abort_all_requests: bool = False
    load_format: str | None = None
    inflight_update_policy: str | None = inflight_field()


class AbortRequest(Body):
    rid: str | int | None = None
    abort_all: bool = False


class PauseGenerationRequest(Body):
    mode: str | None = None
