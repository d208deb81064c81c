"""The engine process's side of vLLM's weight-transfer routes (server/vllm_weights.py).

The engine core (not the HTTP process) joins the trainer's torch.distributed group, receives the
tensors each /update_weights announces in vLLM's stream layout, proves them against the trainer's
declaration and the served model, holds them until the commit and commits them between two steps,
on every tensor-parallel rank. A receive that fails drops the group, so the next trainer can join;
the old weights keep serving. Registered into runtime/core.py's OPS as `vllm_*` operations.
"""

from __future__ import annotations

import hashlib
import logging
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from rlserve import weight_transfer
from rlserve.engine.weights import StagedWeights, WeightUpdateError, stage, void_update

log = logging.getLogger("rlserve.engine.vllm_receiver")


@dataclass
class Receiver:
    """One engine's membership in a trainer's group and the update it is receiving."""

    joining: bool = False
    joined: bool = False
    receiving: bool = False
    open: bool = False  # between /start_weight_update and /finish_weight_update
    packed: bool = True
    buffer_bytes: int = weight_transfer.VLLM_PACKED_BUFFER_BYTES
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    inflight: str | None = None  # the open update's in-flight policy, applied at its commit
    void: str | None = None  # why the open update lost a part: its finish commits nothing
    update: int = 0  # counts starts and finishes: a part lands only in the open update it was sent for


def receiver_of(core: Any) -> Receiver:
    if not hasattr(core, "vllm_receiver"):
        core.vllm_receiver = Receiver()
    return core.vllm_receiver


def _drop_group() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:  # a group whose peer died may fail to close cleanly; it is gone either way
            log.warning("dropping the trainer group: %s", exc)


def op_vllm_init(
    core: Any,
    call_id: int,
    host: str,
    port: int,
    rank: int,
    world: int,
    timeout: float,
    packed: bool | None,
    buffer_bytes: int | None,
) -> object:
    """Join the trainer's group in a thread of its own; reply once the rendezvous completed.
    A new trainer replaces the previous one's group (it may have died without a shutdown)."""
    r = receiver_of(core)
    if r.joining:
        raise RuntimeError("a weight-transfer rendezvous is already waiting; retry once it completes or times out")
    if r.receiving:
        raise RuntimeError("a weight push is being received; call /shutdown_weight_transfer_engine after it")
    _drop_group()
    core.group = None  # rlserve's own /init_broadcaster shares torch.distributed's default group
    r.joined, r.open, r.staged = False, False, {}
    r.packed = True if packed is None else bool(packed)
    r.buffer_bytes = int(buffer_bytes or weight_transfer.VLLM_PACKED_BUFFER_BYTES)
    r.joining = True

    def join() -> None:
        try:
            weight_transfer.init_group(
                host, port, rank, world, timeout, backend="nccl" if core.engine.device.type == "cuda" else "gloo"
            )
        except Exception as exc:
            error = TimeoutError(f"the weight-transfer rendezvous at {host}:{port} failed: {exc}")

            def failed() -> None:
                r.joining = False
                _drop_group()
                core.reply(call_id, None, error)

            core.done.put(failed)
            return

        def joined() -> None:
            r.joining, r.joined = False, True
            core.reply(call_id, None)

        core.done.put(joined)

    # a daemon thread: a server stopped while the rendezvous waits must not wait for it
    threading.Thread(target=join, name="rlserve-vllm-join", daemon=True).start()
    # the core may run as __main__ (python -m rlserve.runtime.core): its own module's marker
    return sys.modules[type(core).__module__].DEFERRED


def op_vllm_shutdown(core: Any, call_id: int) -> None:
    r = receiver_of(core)
    if r.receiving:
        raise RuntimeError("a weight push is being received; shut the weight-transfer engine down after it")
    _drop_group()
    r.joined, r.open, r.staged = False, False, {}


def op_vllm_start(core: Any, call_id: int) -> None:
    r = receiver_of(core)
    r.open, r.staged, r.inflight, r.void = True, {}, None, None
    r.update += 1


def _sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()


def verify(received: list[tuple[str, torch.Tensor]], checksums: dict[str, str] | None) -> None:
    """Compare each tensor with the sha256 of its bytes the trainer declared (vLLM's digest)."""
    if not checksums:
        return
    got = dict(received)
    for name, digest in checksums.items():
        if name not in got:
            raise WeightUpdateError(f"update_info: checksums names {name!r}, which names does not list")
        if _sha256(got[name]) != str(digest).lower():
            raise WeightUpdateError(
                f"update_info: {name} arrived with sha256 {_sha256(got[name])}, the trainer "
                f"declared {digest}: its bytes were not received as sent (check packed and "
                "packed_buffer_size_bytes on both sides)"
            )


class LayoutError(WeightUpdateError):
    """The trainer's broadcasts did not match what its update_info declared: the group is out of step."""


def receive_checked(
    names: list[str], dtypes: list[torch.dtype], shapes: list[list[int]], packed: bool, buffer_bytes: int, device: str
) -> list[tuple[str, torch.Tensor]]:
    """Receive vLLM's stream into one buffer filled with 0xFF first, with as much room again behind it.

    gloo accepts a broadcast shorter than the posted buffer without a word (the tail keeps what was there),
    and kills the whole process on a longer one, so every broadcast lands at its declared offset in a
    buffer longer than what is left to receive; a short one leaves 0xFF (NaN in every float dtype) at
    its end, a long one writes past it. Either names the tensor, before anything is staged."""
    sizes = [int(torch.Size(s).numel()) * d.itemsize for s, d in zip(shapes, dtypes)]
    total = sum(sizes)
    flat = torch.full((2 * total + 64,), 0xFF, dtype=torch.uint8, device=device)
    chunks = weight_transfer.vllm_chunks(sizes, buffer_bytes) if packed else [[i] for i in range(len(sizes))]
    offset = 0
    for chunk in chunks:
        length = sum(sizes[i] for i in chunk)
        dist.broadcast(flat[offset:], src=0)
        end = offset + length
        if bool((flat[end : end + 64] != 0xFF).any()):
            raise LayoutError(
                f"update_info: {names[chunk[-1]]}: the trainer broadcast more bytes than the "
                f"{length} declared for the broadcast ending with it"
            )
        start = offset
        for i in chunk:
            tail = flat[start + sizes[i] - dtypes[i].itemsize : start + sizes[i]]
            if sizes[i] and bool((tail == 0xFF).all()):
                raise LayoutError(
                    f"update_info: {names[i]}: fewer bytes arrived than its declared dtype "
                    f"{str(dtypes[i]).removeprefix('torch.')} and shape {list(shapes[i])} need "
                    f"({sizes[i]})"
                )
            start += sizes[i]
        offset = end
    out, offset = [], 0
    for name, dtype, shape, size in zip(names, dtypes, shapes, sizes):
        out.append((name, flat[offset : offset + size].view(dtype).view(shape)))
        offset += size
    return out


_LAYOUT_HINT = (
    "; check packed and packed_buffer_size_bytes (init_info or update_info) and every tensor's dtype "
    "and shape; the previous weights keep serving and the group is dropped: join again with "
    "/init_weight_transfer_engine"
)


def op_vllm_receive(
    core: Any,
    call_id: int,
    names: list[str],
    dtype_names: list[str],
    shapes: list[list[int]],
    packed: bool | None,
    buffer_bytes: int | None,
    checksums: dict[str, str] | None,
    label: str | None,
    inflight: str | None = None,
) -> object:
    """Receive one /update_weights in the helper thread; without an open update, commit it at once
    (`inflight`: the policy for the requests in flight; within an open update, kept for its finish)."""
    r = receiver_of(core)
    if not r.joined:
        raise RuntimeError("no weight-transfer group: call /init_weight_transfer_engine first")
    dtypes = [getattr(torch, str(d).removeprefix("torch.")) for d in dtype_names]
    use_packed = r.packed if packed is None else bool(packed)
    chunk = int(buffer_bytes or r.buffer_bytes)
    device = "cuda" if core.engine.device.type == "cuda" else "cpu"
    model, commit_now, update = core.engine.model, not r.open, r.update
    r.receiving = True

    def work() -> dict[str, torch.Tensor]:
        try:
            try:
                # receive everything first so the group stays in step with the trainer, then prove it
                received = receive_checked(names, dtypes, shapes, use_packed, chunk, device)
            except LayoutError as exc:
                core.done.put(lambda: _lost(core))
                raise LayoutError(f"{exc}{_LAYOUT_HINT}") from None
            except Exception as exc:
                core.done.put(lambda: _lost(core))
                raise RuntimeError(
                    f"the trainer's broadcast failed ({exc}); the previous weights keep serving "
                    "and the group is dropped: join again with /init_weight_transfer_engine"
                ) from None
            verify(received, checksums)
            staged = stage(model, received, "update_info", require_all=False).tensors
            if commit_now:
                _push_to_ranks(core, call_id, staged)
            return staged
        except BaseException as exc:
            why = str(exc) or type(exc).__name__
            core.done.put(lambda: _failed(r, why, within_update=not commit_now and r.update == update))
            raise

    def commit(staged: dict[str, torch.Tensor]) -> int:
        r.receiving = False
        if not commit_now:
            if not (r.open and r.update == update):  # that update was finished or refused meanwhile
                return core.engine.policy_version
            r.staged.update(staged)
            r.inflight = inflight or r.inflight
            return core.engine.policy_version
        return core.commit_on_ranks(
            call_id, lambda: core.engine.commit_weights(StagedWeights(staged, "update_info"), label, inflight)
        )

    return core.off_loop(call_id, work, commit)


def _failed(r: Receiver, why: str, within_update: bool) -> None:
    """A receive failed: within an open update, the tensors staged before it must not go live alone."""
    r.receiving = False
    if within_update:
        r.void, r.staged, r.inflight = why, {}, None


def _lost(core: Any) -> None:
    r = receiver_of(core)
    _drop_group()
    r.joined, r.open, r.staged, r.receiving = False, False, {}, False


def _push_to_ranks(core: Any, call_id: int, tensors: dict[str, torch.Tensor]) -> None:
    if core.engine.tp is not None:  # each worker gets its slices of the validated tensors
        core.engine.tp.push(call_id, tensors)


def op_vllm_finish(core: Any, call_id: int, label: str | None, inflight: str | None = None) -> object:
    """Commit everything received since /start_weight_update at once. Nothing received: only the label
    moves (as vLLM does), the weights and policy_version stay."""
    r = receiver_of(core)
    staged, r.staged, r.open = r.staged, {}, False
    inflight, r.inflight = inflight or r.inflight, None
    r.update += 1
    if r.receiving and r.void is None:  # finished before its last part arrived
        r.void = "a part was still being received at the finish"
    if r.void is not None:
        why, r.void = r.void, None
        raise RuntimeError(void_update(why, core.engine.policy_version, core.engine.weight_version))
    if not staged:
        if label is not None:
            core.engine.weight_version = label
        return core.engine.policy_version
    return core.off_loop(
        call_id,
        lambda: _push_to_ranks(core, call_id, staged) or staged,
        lambda tensors: core.commit_on_ranks(
            call_id, lambda: core.engine.commit_weights(StagedWeights(tensors, "update_info"), label, inflight)
        ),
    )


def op_vllm_checksums(core: Any, call_id: int, prefix: str) -> dict[str, str]:
    """vLLM's /weight_checker digests: sha256 of each parameter's bytes as this rank holds them."""
    return {prefix + name: _sha256(p) for name, p in core.engine.model.named_parameters()}


def op_vllm_reset_weights(core: Any, call_id: int) -> None:
    if core.engine.tp is not None:
        raise ValueError("weight_checker reset zeroes one rank's weights only; it is refused under tensor parallelism")
    with torch.no_grad():
        for p in core.engine.model.parameters():
            p.zero_()
    core.engine.model.refresh_packed()


OPS = {name[3:]: fn for name, fn in dict(globals()).items() if name.startswith("op_vllm_")}
