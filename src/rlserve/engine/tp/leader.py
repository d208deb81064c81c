"""Tensor-parallel ranks of one engine core: rank 0 (the engine core process) and its workers.

Rank 0 schedules, samples and answers the server; ranks 1..tp-1 are worker processes it starts
(`python -m rlserve.engine.tp.worker`, the config as JSON on stdin, or the same told to a child the engine core
forked before it loaded its model: forked.py) and stops. Each step rank 0
sends the step's inputs (token ids, positions, the attention batch as fixed-schema msgspec over
ZeroMQ, never pickle), then every rank runs its shard (model/tensor_parallel.py) and the layers
sum their partial outputs with an all-reduce on the step group (gloo on CPU, NCCL on CUDA).
Weight updates and adapters are staged on every rank and committed at the same step boundary:
rank 0 sends Commit before the next Step, and each worker reads its inbox in order.

A worker that dies fails the engine: rank 0 checks its workers' processes every loop turn and
its collectives time out; the worker that raises reports why before it exits. Workers die with
rank 0 (PR_SET_PDEATHSIG) and leave when their parent process changes.
"""

from __future__ import annotations

import datetime
import json
import logging
import subprocess
import threading
import time
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import zmq

from rlserve.config.schema import Config
from rlserve.engine.child import start_tp_worker
from rlserve.engine.tp import forked
from rlserve.engine.tp.comm import (
    POLL_MS,
    START_TIMEOUT_S,
    Commit,
    Died,
    Discard,
    Loaded,
    Move,
    RemoveAdapter,
    Stage,
    Staged,
    Stop,
    attach,
    encode,
    encode_step,
    gather_all,
    gather_bytes,
    make_group,
    send_bytes,
    to_leader,
)
from rlserve.engine.tp.kv_transfer import uses_kv_group
from rlserve.model.batch import AttentionBatch
from rlserve.model.llama import CausalLM
from rlserve.model.shape import ModelShape

log = logging.getLogger("rlserve.engine.tp.leader")


class TensorParallelLeader:
    """Rank 0's view of its workers: starts them, feeds them steps and staged work, stops them."""

    def __init__(self, config: Config, shape: ModelShape, num_blocks: int, device: torch.device):
        self.tp = config.parallel.tp
        self.config = config
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds rank 0 to the current device
        ranks = config.parallel.ray_ranks
        host = "127.0.0.1"
        if ranks is not None and set(ranks.bundles) != {ranks.bundles[0]}:  # some ranks on other nodes
            from rlserve.engine.tp.ray_ranks import join_cluster

            host = join_cluster(ranks)
        self.store = dist.TCPStore(
            host, 0, self.tp, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S), wait_for_workers=False
        )
        self.ctx = zmq.Context()
        self.replies = self._socket(zmq.PULL)
        reply_port = self.replies.bind_to_random_port(f"tcp://{host}")
        self.inboxes: list[zmq.Socket] = []
        self.procs: list = []  # subprocess.Popen, a ForkedProcess (forked.py), or a RayRank (ray_ranks.py)
        self.send_lock = threading.Lock()  # steps from the loop thread, staged work from the helper
        self.failure: str | None = None
        self.moves: list[Move] = []  # rank 0's KV offload moves, sent with the next step (tp/offload.py)
        try:
            payload = config.model_dump_json().encode()
            for rank in range(1, self.tp):
                inbox = self._socket(zmq.PUSH)
                port = inbox.bind_to_random_port(f"tcp://{host}")
                self.inboxes.append(inbox)
                args = [
                    str(rank),
                    str(self.tp),
                    f"{host}:{self.store.port}",
                    f"tcp://{host}:{port}",
                    f"tcp://{host}:{reply_port}",
                    str(num_blocks),
                    str(device),
                    json.dumps(asdict(shape)),  # rank 0's reading of config.json: workers need not import transformers
                ]
                self.procs.append(self._start_rank(rank, args, payload))
            self._wait_loaded()
            # every worker is up and creating these same groups now
            self.step_group = make_group(self.store, "step", 0, self.tp, self.backend)
            self.weights_group = make_group(self.store, "weights", 0, self.tp, "gloo")
            # whole KV blocks are gathered on a group of their own: the weights group serves staged work meanwhile
            self.kv_group = make_group(self.store, "kv", 0, self.tp, "gloo") if uses_kv_group(config) else None
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (%s), workers %s", self.tp, self.backend, [p.pid for p in self.procs])

    def _start_rank(self, rank: int, args: list[str], payload: bytes):
        if not forked.on_rank0_machine(self.config, rank):
            from rlserve.engine.tp.ray_ranks import RayRank

            return RayRank(self.config.parallel.ray_ranks, rank, args, payload)
        return forked.start(rank, args, payload) or start_tp_worker(args, payload)

    def _socket(self, kind: int) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        return sock

    def _wait_loaded(self) -> None:
        waiting = set(range(1, self.tp))
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            msg = self._next_reply(deadline)
            if isinstance(msg, Loaded):
                waiting.discard(msg.rank)

    def _next_reply(self, deadline: float) -> Loaded | Staged:
        """The next worker message; raises when a worker died or reported a failure, or at the deadline."""
        while True:
            if self.replies.poll(POLL_MS):
                msg = to_leader.decode(self.replies.recv())
                if isinstance(msg, Died):
                    self.failure = f"tensor-parallel rank {msg.rank} failed: {msg.message}"
                    raise RuntimeError(self.failure)
                return msg
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError("tensor-parallel workers did not answer in time")

    def check(self) -> None:
        """Raises when a worker process has exited: the engine cannot step without it."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                self.failure = self.failure or f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                raise RuntimeError(self.failure)

    def explain(self, exc: BaseException) -> str:
        """Why a step failed: a collective error usually means a rank died; name it when one did."""
        deadline = time.monotonic() + 2  # a killed rank's peers notice before its parent can reap it
        while True:
            try:
                self.check()
            except RuntimeError as dead:
                return f"{dead} ({exc!r})"
            if time.monotonic() > deadline:
                return repr(exc)
            time.sleep(0.05)

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def attach(self, model: CausalLM) -> None:
        attach(model, self.step_group, 0, self.config)

    def _broadcast(self, raw: bytes) -> None:
        with self.send_lock:
            for inbox in self.inboxes:
                inbox.send(raw)

    def send_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBatch,
        block_copies: list[tuple[int, int]],
    ) -> None:
        moves, self.moves = self.moves, []
        self._broadcast(encode_step(input_ids, positions, attn, block_copies, moves))

    def record_move(self, kind: str, block: int, slot: int, key: bytes) -> None:
        """Rank 0's offload tier moved a block: every worker moves its slice alike before the next step."""
        self.moves.append(Move(kind, block, slot, key))

    # ---- staged work: every worker stages, then all commit at one step boundary ---------------

    def stage(self, call_id: int, kind: str, args: list[Any]) -> None:
        self._broadcast(encode(Stage(call_id, kind, args)))

    def wait_staged(self, call_id: int) -> None:
        """Every worker's answer to Stage(call_id); on any failure all workers drop it and this raises."""
        from rlserve.engine.error_kinds import rebuild_error

        waiting, errors = set(range(1, self.tp)), []
        deadline = time.monotonic() + START_TIMEOUT_S
        while waiting:
            msg = self._next_reply(deadline)
            if isinstance(msg, Staged) and msg.call_id == call_id:
                waiting.discard(msg.rank)
                if msg.error is not None:
                    errors.append(rebuild_error(msg.error_kind, f"tensor-parallel rank {msg.rank}: {msg.error}"))
        if errors:
            self.discard(call_id)
            raise errors[0]

    def staged(self, call_id: int, kind: str, args: list[Any], local: Any) -> Any:
        """Stage on the workers and run `local()` (rank 0's staging) meanwhile; its result, once all succeeded."""
        self.stage(call_id, kind, args)
        try:
            result = local()
        except BaseException:
            try:
                self.wait_staged(call_id)
            finally:
                self.discard(call_id)
            raise
        self.wait_staged(call_id)
        return result

    def push(self, call_id: int, tensors: dict[str, torch.Tensor]) -> None:
        """Scatter a validated trainer push: each worker gets its slices over the weights group."""
        entries = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
        self.stage(call_id, "push", entries)
        for name, tensor in tensors.items():
            send_bytes(self.weights_group, tensor.cpu(), 0, self.tp, name, self.config.parallel.enable_expert_parallel)
        self.wait_staged(call_id)

    def gather(self, call_id: int, model: CausalLM) -> dict[str, torch.Tensor]:
        """The full checkpoint as the ranks serve it now: each tensor put together from every rank's slice
        (copies on the CPU). Called between steps."""
        from rlserve.model.expert_parallel import primary_experts, shared_names, slot_names
        from rlserve.model.loader import checkpoint_shapes, target_of
        from rlserve.model.tensor_parallel import unshard

        names, slots = shared_names(model, checkpoint_shapes(model.full_shape)), slot_names(model)
        whole = self.config.parallel.enable_expert_parallel
        params = dict(model.named_parameters())
        self.stage(call_id, "gather", [names, slots])
        try:
            out = {}
            for name in names:
                parts = gather_bytes(self.weights_group, target_of(model, params, name).cpu(), 0, self.tp, name, whole)
                out[name] = unshard(name, parts, whole).clone()
            # expert parallelism: every rank's own slots, of which this engine's part keeps the first replicas
            held = {name: gather_all(self.weights_group, params[name].cpu(), 0, self.tp) for name in slots}
            out |= primary_experts(model, held)
            self.wait_staged(call_id)
        finally:
            self.discard(call_id)
        return out

    def commit(self, call_id: int) -> None:
        self._broadcast(encode(Commit(call_id)))

    def discard(self, call_id: int) -> None:
        self._broadcast(encode(Discard(call_id)))

    def remove_adapter(self, name: str) -> None:
        self._broadcast(encode(RemoveAdapter(name)))

    def close(self) -> None:
        """Stop every worker: ask, wait a little, then kill; no process is left behind."""
        stop = encode(Stop())
        with self.send_lock:
            for inbox in self.inboxes:
                try:  # a dead worker's inbox has no peer left: a blocking send would wait forever
                    inbox.send(stop, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for sock in [*self.inboxes, self.replies]:
            sock.close(linger=0)
        self.ctx.term()
        if self.config.parallel.ray_ranks is not None:
            from rlserve.engine.tp.ray_ranks import leave_cluster

            leave_cluster()
