"""Tensor-parallel ranks of one engine core: rank 0 (the engine core process) and its workers.

Rank 0 schedules, samples and answers the server; ranks 1..tp-1 are worker processes it starts
(`python -m rlserve.engine.tp.leader`, the config as JSON on stdin) and stops. Each step rank 0
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
import logging
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
import torch
import torch.distributed as dist
import zmq

from rlserve.config.schema import Config
from rlserve.runtime.ipc import connect_pair, parent_pid, start_child
from rlserve.runtime.spawn import child_env
from rlserve.model.llama import AttentionBatch, CascadePlan, CausalLM, PrefillSeq
from rlserve.model.tensor_parallel import shard, shard_dim

log = logging.getLogger("rlserve.engine.tp.leader")
COLLECTIVE_TIMEOUT_S = 120.0  # a rank waiting this long in one collective gives up (the other is gone or stuck)
START_TIMEOUT_S = 600.0  # a worker loading its shard
POLL_MS = 200

# ---- wire: rank 0 -> workers ---------------------------------------------------------------

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.int64, torch.int32, torch.bool, torch.float32,
                                                          torch.bfloat16, torch.float16, torch.float64)}


class Tensor(msgspec.Struct, array_like=True):
    dtype: str  # one of _DTYPES
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor | None) -> "Tensor | None":
        if t is None:
            return None
        t = t.detach().contiguous().cpu()
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())

    def to(self, device: torch.device) -> torch.Tensor:
        dtype = _DTYPES[self.dtype]
        raw = torch.frombuffer(bytearray(self.data), dtype=torch.uint8) if self.data else torch.empty(0, dtype=torch.uint8)
        return raw.view(dtype).view(self.shape).to(device)


def _tensor(t: Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


class Prefill(msgspec.Struct, array_like=True):
    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: Tensor | None
    mask: Tensor | None


class Cascade(msgspec.Struct, array_like=True):
    prefix_blocks: Tensor
    prefix_mask: Tensor | None
    group_width: int
    num_grouped: int
    query_rows: Tensor | None
    suffix_blocks: Tensor
    suffix_mask: Tensor


class Step(msgspec.Struct, tag=True, array_like=True):
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    num_decode: int
    decode_blocks: Tensor | None
    decode_mask: Tensor | None
    decode_lens: Tensor | None
    cascade: Cascade | None
    prefills: list[Prefill]
    block_size: int
    lora: list[tuple[str, Tensor]]  # (adapter name, its rows)
    block_copies: list[tuple[int, int]]
    kernels: bool  # rank 0 ran the C kernels (no decode mask was built): so must every rank


class Stage(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    kind: str  # dir [weight_dir, roots] | adapter [name, path, roots] | push [[name, dtype, full shape], ...]
    args: list[Any]


class Commit(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class Discard(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class RemoveAdapter(msgspec.Struct, tag=True, array_like=True):
    name: str


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


ToWorker = Step | Stage | Commit | Discard | RemoveAdapter | Stop

# ---- wire: workers -> rank 0 ---------------------------------------------------------------


class Loaded(msgspec.Struct, tag=True, array_like=True):
    rank: int


class Staged(msgspec.Struct, tag=True, array_like=True):
    rank: int
    call_id: int
    error_kind: str | None
    error: str | None


class Died(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str


ToLeader = Loaded | Staged | Died
_encode = msgspec.msgpack.Encoder().encode
_to_worker = msgspec.msgpack.Decoder(ToWorker)
_to_leader = msgspec.msgpack.Decoder(ToLeader)


def encode_step(input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch,
                block_copies: list[tuple[int, int]]) -> bytes:
    c = attn.cascade
    cascade = None if c is None else Cascade(
        Tensor.of(c.prefix_blocks), Tensor.of(c.prefix_mask), c.group_width, c.num_grouped, Tensor.of(c.query_rows),
        Tensor.of(c.suffix_blocks), Tensor.of(c.suffix_mask))
    lora = [] if attn.lora is None else [(adapter.name, Tensor.of(rows)) for adapter, rows in attn.lora.segments]
    return _encode(Step(
        Tensor.of(input_ids), Tensor.of(positions), Tensor.of(attn.slot_mapping), attn.num_decode,
        Tensor.of(attn.decode_blocks), Tensor.of(attn.decode_mask), Tensor.of(attn.decode_lens), cascade,
        [Prefill(p.q_start, p.q_len, p.ctx_len, Tensor.of(p.ctx_slots), Tensor.of(p.mask)) for p in attn.prefills],
        attn.block_size, lora, [tuple(c) for c in block_copies], attn.kernels is not None))


# ---- process groups ------------------------------------------------------------------------


def make_group(store: dist.Store, name: str, rank: int, world: int, backend: str) -> Any:
    """A process group of its own (not torch.distributed's default one, which a trainer broadcaster uses)."""
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    prefixed = dist.PrefixStore(name, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def attach(model: CausalLM, group: Any) -> None:
    """Make the row-parallel layers (o_proj, down_proj) sum their partial outputs across ranks."""

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # the swapped CPU GEMM returns a transposed view
        group.allreduce([t]).wait()
        return t

    for layer in model.layers:
        layer.self_attn.reduce = all_reduce
        layer.mlp.reduce = all_reduce


def device_of_rank(device: torch.device, rank: int) -> torch.device:
    """CPU for every rank; on CUDA one device per rank, counting from rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _send_bytes(group: Any, tensor: torch.Tensor, rank: int, tp: int, name: str) -> torch.Tensor | None:
    """Scatter `name`'s slices from rank 0 (or broadcast it whole when it is replicated); returns
    this rank's part on workers. Bytes on gloo, so any dtype crosses."""
    dim = shard_dim(name)
    if dim is None:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        group.broadcast([flat], _root0(dist.BroadcastOptions())).wait()
        return flat
    if rank == 0:
        parts = [shard(name, tensor, r, tp).contiguous().view(-1).view(torch.uint8) for r in range(tp)]
        group.scatter([torch.empty_like(parts[0])], [parts], _root0(dist.ScatterOptions())).wait()
        return None
    out = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    group.scatter([out], [], _root0(dist.ScatterOptions())).wait()
    return out


def _root0(opts: Any) -> Any:
    opts.rootRank = 0
    return opts


# ---- rank 0 --------------------------------------------------------------------------------


class TensorParallelLeader:
    """Rank 0's view of its workers: starts them, feeds them steps and staged work, stops them."""

    def __init__(self, config: Config, num_blocks: int, device: torch.device):
        self.tp = config.parallel.tp
        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)  # NCCL binds rank 0 to the current device
        self.store = dist.TCPStore("127.0.0.1", 0, self.tp, True, timeout=datetime.timedelta(seconds=START_TIMEOUT_S),
                                   wait_for_workers=False)
        self.ctx = zmq.Context()
        self.replies = self._socket(zmq.PULL)
        reply_port = self.replies.bind_to_random_port("tcp://127.0.0.1")
        self.inboxes: list[zmq.Socket] = []
        self.procs: list[subprocess.Popen] = []
        self.send_lock = threading.Lock()  # steps from the loop thread, staged work from the helper
        self.failure: str | None = None
        try:
            payload = config.model_dump_json().encode()
            for rank in range(1, self.tp):
                inbox = self._socket(zmq.PUSH)
                port = inbox.bind_to_random_port("tcp://127.0.0.1")
                self.inboxes.append(inbox)
                proc = subprocess.Popen(
                    [sys.executable, "-m", "rlserve.engine.tp.leader", str(rank), str(self.tp), str(self.store.port),
                     f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{reply_port}", str(num_blocks), str(device)],
                    stdin=subprocess.PIPE, env=child_env())
                proc.stdin.write(payload)
                proc.stdin.close()
                self.procs.append(proc)
            self._wait_loaded()
            # every worker is up and creating these same groups now
            self.step_group = make_group(self.store, "step", 0, self.tp, self.backend)
            self.weights_group = make_group(self.store, "weights", 0, self.tp, "gloo")
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (%s), workers %s", self.tp, self.backend, [p.pid for p in self.procs])

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
                msg = _to_leader.decode(self.replies.recv())
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
        attach(model, self.step_group)

    def _broadcast(self, raw: bytes) -> None:
        with self.send_lock:
            for inbox in self.inboxes:
                inbox.send(raw)

    def send_step(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionBatch,
                  block_copies: list[tuple[int, int]]) -> None:
        self._broadcast(encode_step(input_ids, positions, attn, block_copies))

    # ---- staged work: every worker stages, then all commit at one step boundary ---------------

    def stage(self, call_id: int, kind: str, args: list[Any]) -> None:
        self._broadcast(_encode(Stage(call_id, kind, args)))

    def wait_staged(self, call_id: int) -> None:
        """Every worker's answer to Stage(call_id); on any failure all workers drop it and this raises."""
        from rlserve.runtime.ipc import rebuild_error

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
            _send_bytes(self.weights_group, tensor.cpu(), 0, self.tp, name)
        self.wait_staged(call_id)

    def commit(self, call_id: int) -> None:
        self._broadcast(_encode(Commit(call_id)))

    def discard(self, call_id: int) -> None:
        self._broadcast(_encode(Discard(call_id)))

    def remove_adapter(self, name: str) -> None:
        self._broadcast(_encode(RemoveAdapter(name)))

    def close(self) -> None:
        """Stop every worker: ask, wait a little, then kill; no process is left behind."""
        try:
            self._broadcast(_encode(Stop()))
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


# ---- workers -------------------------------------------------------------------------------


class Worker:
    def __init__(self, rank: int, tp: int, config: Config, num_blocks: int, device: torch.device, replies: zmq.Socket):
        from rlserve.engine.engine import resolve_dtype
        from rlserve.engine.runner import ModelRunner
        from rlserve.engine.weights import StagingBuffers
        from rlserve.model.llama import ModelShape
        from rlserve.model.loader import load_model, resolve_model_dir
        from transformers import AutoConfig

        self.rank, self.tp, self.config, self.device, self.replies = rank, tp, config, device, replies
        self.dtype = resolve_dtype(config.model.dtype, device)
        model_dir = resolve_model_dir(config.model.name)
        self.shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir,
                                                                   trust_remote_code=config.model.trust_remote_code))
        self.model = load_model(model_dir, self.shape, self.dtype, device, rank, tp)
        ec = config.engine
        self.runner = ModelRunner(self.model, num_blocks, ec.block_size, self.dtype, device,
                                  cascade_attention=ec.cascade_attention, pack_weights=ec.pack_weights,
                                  use_cpu_kernels=ec.cpu_kernels)
        self.adapters: dict = {}
        self.staged: dict[int, Any] = {}  # call id -> ("weights", StagedWeights) | ("adapter", LoraAdapter)
        self.staged_lock = threading.Lock()
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="rlserve-tp-stage")
        self.buffers = StagingBuffers()
        self.reply_lock = threading.Lock()

    def join_groups(self, store: dist.Store) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.step_group = make_group(store, "step", self.rank, self.tp, backend)
        self.weights_group = make_group(store, "weights", self.rank, self.tp, "gloo")
        attach(self.model, self.step_group)

    def reply(self, msg: Any) -> None:
        with self.reply_lock:
            self.replies.send(_encode(msg))

    @torch.inference_mode()
    def run_step(self, msg: Step) -> None:
        dev = self.device
        if msg.block_copies:
            self.runner._copy_blocks(msg.block_copies)
        c = msg.cascade
        cascade = None if c is None else CascadePlan(
            c.prefix_blocks.to(dev), _tensor(c.prefix_mask, dev), c.group_width, c.num_grouped,
            _tensor(c.query_rows, dev), c.suffix_blocks.to(dev), c.suffix_mask.to(dev))
        lora = None
        if msg.lora:
            from rlserve.model.lora import LoraBatch

            lora = LoraBatch([(self.adapters[name], rows.to(dev)) for name, rows in msg.lora], self.model.shape)
        kernels = self.runner.kernels if msg.kernels else None
        if msg.kernels and kernels is None:
            raise RuntimeError("rank 0 runs the C kernels and this rank cannot load them")
        attn = AttentionBatch(
            slot_mapping=msg.slot_mapping.to(dev), num_decode=msg.num_decode, decode_blocks=_tensor(msg.decode_blocks, dev),
            decode_mask=_tensor(msg.decode_mask, dev), decode_lens=_tensor(msg.decode_lens, dev), cascade=cascade,
            prefills=[PrefillSeq(p.q_start, p.q_len, p.ctx_len, _tensor(p.ctx_slots, dev), _tensor(p.mask, dev))
                      for p in msg.prefills],
            block_size=msg.block_size, lora=lora, kernels=kernels)
        self.model(msg.input_ids.to(dev), msg.positions.to(dev), attn, self.runner.kv_cache)

    # staged work runs in the helper thread, so steps go on meanwhile
    def stage(self, msg: Stage) -> None:
        from rlserve.runtime.ipc import error_kind

        try:
            staged = self._stage(msg)
        except Exception as exc:
            self.reply(Staged(self.rank, msg.call_id, error_kind(exc), str(exc)))
            return
        with self.staged_lock:
            self.staged[msg.call_id] = staged
        self.reply(Staged(self.rank, msg.call_id, None, None))

    def _stage(self, msg: Stage) -> Any:
        from rlserve.engine.weights import StagedWeights, check_under_roots, stage_from_dir

        if msg.kind == "dir":
            weight_dir, roots = msg.args
            return "weights", stage_from_dir(self.model, check_under_roots(weight_dir, roots), self.buffers, roots)
        if msg.kind == "adapter":
            from rlserve.model.lora import load_peft_adapter
            from rlserve.model.tensor_parallel import shard_adapter

            name, path, roots = msg.args
            adapter = load_peft_adapter(name, check_under_roots(path, roots), self.shape, self.dtype, self.device, roots)
            return "adapter", shard_adapter(adapter, self.rank, self.tp)
        if msg.kind == "push":
            tensors = {}
            for name, dtype, full in msg.args:
                dt = _DTYPES[dtype]
                part = torch.empty(shard(name, torch.empty(full, dtype=dt, device="meta"), self.rank, self.tp).shape, dtype=dt)
                raw = _send_bytes(self.weights_group, part, self.rank, self.tp, name)
                tensors[name] = raw.view(dt).view(part.shape).to(self.device)
            # rank 0 validated the full tensors already; these are this rank's slices
            return "weights", StagedWeights(tensors, "broadcast", sharded=True)
        raise ValueError(f"unknown staged work {msg.kind!r}")

    def commit(self, call_id: int) -> None:
        from rlserve.engine.weights import commit

        with self.staged_lock:
            kind, staged = self.staged.pop(call_id)
        if kind == "weights":
            commit(self.model, staged)
        else:
            self.adapters[staged.name] = staged

    def serve(self, inbox: zmq.Socket) -> None:
        parent = parent_pid()
        while True:
            if not inbox.poll(1000):
                if os.getppid() != parent:
                    return
                continue
            msg = _to_worker.decode(inbox.recv())
            if isinstance(msg, Step):
                self.run_step(msg)
            elif isinstance(msg, Stage):
                self.helper.submit(self.stage, msg)
            elif isinstance(msg, Commit):
                self.commit(msg.call_id)
            elif isinstance(msg, Discard):
                with self.staged_lock:
                    self.staged.pop(msg.call_id, None)
            elif isinstance(msg, RemoveAdapter):
                self.adapters.pop(msg.name, None)
            else:
                return


def worker_main(argv: list[str]) -> int:
    rank, tp, store_port, inbox_addr, reply_addr, num_blocks, device = argv
    config = start_child()
    if config is None:
        return 1
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    rank_i, tp_i = int(rank), int(tp)
    dev = device_of_rank(torch.device(device), rank_i)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    inbox, replies = connect_pair(zmq.Context(), inbox_addr, reply_addr, 2000)
    try:
        worker = Worker(rank_i, tp_i, config, int(num_blocks), dev, replies)
        store = dist.TCPStore("127.0.0.1", int(store_port), tp_i, False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        replies.send(_encode(Loaded(rank_i)))
        worker.join_groups(store)
        worker.serve(inbox)
    except BaseException as exc:
        log.exception("tensor-parallel rank %s died", rank)
        replies.send(_encode(Died(rank_i, repr(exc))))
        return 1
    finally:
        inbox.close(linger=0)
        replies.close(linger=2000)
    return 0


if __name__ == "__main__":
    code = worker_main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # without waiting for the helper thread
