"""Membership of a trainer's weight-broadcast group (/init_broadcaster), one trainer at a time.

torch.distributed allows one default group per process, so an engine still in an earlier trainer's
group cannot join the next one. Before joining, the earlier group is probed through its store (a TCP
connection to the earlier trainer): if that trainer is gone the engine leaves its group and joins the
new one; if it is still running the join is refused, naming the fix. A push cut off by a trainer that
died mid-broadcast fails (the server keeps the old weights) and its group is left the same way.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future

log = logging.getLogger("rlserve.engine")


class TrainerStillConnected(RuntimeError):
    """A 409 for the caller: the earlier trainer is alive and holds this engine in its group."""


def leave_earlier_group(joining: Future | None, peer: str | None) -> None:
    """Leave the group `joining` set up, unless its trainer (at `peer`) still answers: then raise
    TrainerStillConnected. Runs off the engine loop: the probe waits on the network."""
    import torch.distributed as dist

    if joining is None:
        return
    if not joining.done():
        raise TrainerStillConnected(
            f"the engine is still joining the weight-broadcast group of the trainer at "
            f"{peer}: wait for that /init_broadcaster to finish or time out"
        )
    if joining.exception() is not None or not dist.is_initialized():
        return  # that join failed: there is no group to leave
    if _trainer_answers():
        raise TrainerStillConnected(
            f"the engine is still in the weight-broadcast group of an earlier trainer at {peer}, which is still "
            "running: stop that trainer (or call its WeightBroadcaster.close()) before starting another, or "
            "restart this server"
        )
    dist.destroy_process_group()
    log.warning("left the weight-broadcast group of the trainer at %s: that trainer is gone", peer)


def _trainer_answers() -> bool:
    """The group's store is served by the trainer (rank 0); a closed connection means it is gone."""
    from torch.distributed import distributed_c10d

    try:
        distributed_c10d._get_default_store().check(["rlserve/alive"])
    except RuntimeError:  # DistNetworkError: connection reset / broken pipe
        return False
    return True


def receive_push(device: str, staging) -> list:
    """One push's tensors; a RuntimeError saying nothing was applied when the trainer dies or stalls mid-push."""
    from rlserve import weight_transfer

    try:
        return weight_transfer.receive(device, staging)
    except RuntimeError as exc:
        raise RuntimeError(
            f"the weight push was cut off ({str(exc).splitlines()[0]}); the previous weights keep "
            "serving; the next trainer's /init_broadcaster starts a new group"
        ) from None
