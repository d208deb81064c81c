"""The engine core process: the step loop, alone with the model, fed over ZeroMQ (runtime/ipc.py).

Between two steps it takes new requests, aborts and named control operations off its inbox; after
each step it sends the outputs of the requests the step touched, as one message. Slow control
work (reading weights or adapters, receiving a trainer push) runs in a helper thread and is
committed between two steps, as in the in-thread AsyncEngine. Started by runtime/spawn.py: forked from
the server (main_forked), or `python -m rlserve.runtime.core IN_ADDR OUT_ADDR` with the config as JSON on
stdin (main).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from rlserve.config.load import configure_logging
from rlserve.config.schema import Config
from rlserve.engine import child, error_kinds
from rlserve.engine.engine import Engine
from rlserve.engine.sequence import Request
from rlserve.engine.tp import forked as tp_forked
from rlserve.engine.tp.dp_sync import DataParallelSync
from rlserve.engine.weights import StagingBuffers, check_under_roots, stage, stage_from_dir
from rlserve.runtime import ipc, output_delta, sleep, vllm_receiver, weight_snapshot
from rlserve.runtime.heap import freeze_startup_heap
from rlserve.runtime.pause import PauseState

log = logging.getLogger("rlserve.runtime.core")
IDLE_POLL_MS = 50  # how long an idle loop sleeps on its inbox before looking at helpers and its parent


class EngineCore:
    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket):
        self.engine, self.inbox, self.outbox = engine, inbox, outbox
        self.streams: dict[int, list] = {}  # key -> [request, every step wanted, what the server holds]
        self.keys: dict[int, int] = {}  # id(request) -> key
        self.pause = PauseState()
        self.stop = False
        self.done: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()  # helper results, run between steps
        self.drains: list[int] = []  # call ids of pause(mode=wait) waiting for in-flight requests to finish
        self.stepping: list[int] = []  # call ids of a step-limited resume waiting for its last step
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="rlserve-stage")  # one update at a time
        self.group: Future | None = None  # torch.distributed group with a trainer, being joined
        self.group_peer: str | None = None  # that trainer's host:port
        self.staging = StagingBuffers()
        self.poller = zmq.Poller()
        self.poller.register(inbox, zmq.POLLIN)
        self.landed_r = None
        p = engine.config.parallel
        self.dp_sync = DataParallelSync(engine.config) if p.enable_expert_parallel and p.dp_total > 1 else None
        if engine.kv_transfer is not None:  # a pull thread wakes the loop when its blocks have landed
            self.landed_r, self.landed_w = os.pipe()
            os.set_blocking(self.landed_r, False)
            os.set_blocking(self.landed_w, False)
            self.poller.register(self.landed_r, zmq.POLLIN)
            engine.kv_transfer.wake = self.wake

    # ---- the loop ---------------------------------------------------------------------------

    def run(self) -> None:
        engine, parent = self.engine, child.parent_pid()
        while not self.stop:
            busy = engine.has_unfinished() and not self.pause.paused
            busy = busy or (self.dp_sync is not None and self.dp_sync.peers_busy)  # no sleeping through their steps
            # a batch-forming window holding an idle engine's first requests: sleep on the inbox until it ends
            hold_ms = math.ceil(engine.scheduler.admission_delay() * 1000) if busy else 0
            if self.poller.poll(hold_ms if busy else IDLE_POLL_MS):
                if self.landed_r is not None:
                    try:
                        os.read(self.landed_r, 4096)
                    except BlockingIOError:
                        pass
                while True:
                    try:
                        raw = self.inbox.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.receive(raw)
            while not self.done.empty():
                self.done.get_nowait()()
            engine.poll_transfers()
            if self.dp_sync is not None:  # engines sharing expert layers forward together
                self.dispatch(self.dp_sync.step(engine, self.pause.paused))
            elif self.pause.paused:
                self.dispatch(engine.take_pending())
            elif engine.has_unfinished():
                self.dispatch(engine.step_requests())
            if self.pause.stepped(engine):
                self.reply_all(self.stepping, None)
            if self.drains and self.pause.drained(engine):
                self.reply_all(self.drains, 0)
            if engine.tp is not None:
                engine.tp.check()  # a dead rank fails the engine now, not at its next collective
            if not busy and os.getppid() != parent:  # the server is gone: nobody will read our outputs
                return

    def wake(self) -> None:
        try:
            os.write(self.landed_w, b"\0")
        except BlockingIOError:  # the pipe is full of wakeups already
            pass

    def dispatch(self, touched: list[Request]) -> None:
        items = []
        for req in touched:
            key = self.keys.get(id(req))
            if key is None:
                continue
            target = self.streams[key]
            if target[1] or not target[2].messages or req.finished:
                items.append(ipc.Delta(key, *output_delta.trim(req.output(), target[2])))
            if req.finished:
                self.forget(key)
        if items:
            self.outbox.send(ipc.encode(ipc.Outputs(items, self.state())))

    def forget(self, key: int) -> None:
        target = self.streams.pop(key, None)
        if target is not None:
            self.keys.pop(id(target[0]), None)

    def handle(self, msg: ipc.ToEngine) -> None:
        if isinstance(msg, ipc.Add):
            refused = sleep.refusal(self)
            if refused is not None:  # sleep level 2: the weights are not there to run on
                self.outbox.send(ipc.encode(ipc.Rejected(msg.key, refused, unavailable=True)))
                return
            try:
                req = self.engine.make_request(
                    msg.request_id, msg.prompt, msg.params, cache_salt=msg.cache_salt, adapter=msg.adapter
                )
            except ValueError as exc:
                self.outbox.send(ipc.encode(ipc.Rejected(msg.key, str(exc))))
                return
            self.streams[msg.key] = [req, msg.stream, output_delta.Sent()]
            self.keys[id(req)] = msg.key
            self.engine.submit(req)
        elif isinstance(msg, ipc.Abort):
            target = self.streams.get(msg.key)
            if target is not None:
                self.forget(msg.key)
                self.engine.abort_request(target[0])
        elif isinstance(msg, ipc.Call):
            op = OPS.get(msg.op)
            if op is None:
                self.reply(msg.call_id, None, KeyError(f"unknown engine operation {msg.op!r}"))
                return
            try:
                result = op(self, msg.call_id, *msg.args)
            except Exception as exc:  # the caller gets it; the engine keeps serving
                self.reply(msg.call_id, None, exc)
            else:
                if result is not DEFERRED:
                    self.reply(msg.call_id, result)
        else:
            self.stop = True

    # ---- replies ----------------------------------------------------------------------------

    def state(self) -> ipc.State:
        e = self.engine
        return ipc.State(
            e.policy_version,
            e.weight_version,
            {n: a.path for n, a in e.adapters.items()},
            self.pause.paused,
            dataclasses.asdict(e.stats),
        )

    def receive(self, raw: bytes) -> None:
        try:
            msg = ipc.to_engine.decode(raw)
        except msgspec.ValidationError as exc:
            # a value our own checks refuse (sampling params validate on decode): refuse that message, keep serving
            self.refuse(raw, exc)
            return
        self.handle(msg)

    def refuse(self, raw: bytes, exc: msgspec.ValidationError) -> None:
        fields = msgspec.msgpack.decode(raw)
        tag, ident = (fields[0], fields[1]) if isinstance(fields, list) and len(fields) > 1 else (None, None)
        if tag == "Add" and isinstance(ident, int):
            self.outbox.send(ipc.encode(ipc.Rejected(ident, str(exc))))
        elif tag == "Call" and isinstance(ident, int):
            self.reply(ident, None, ValueError(str(exc)))
        else:
            log.error("engine core: dropped a message it cannot read: %s", exc)

    def reply(self, call_id: int, value: Any, exc: BaseException | None = None) -> None:
        kind, message = (error_kinds.error_kind(exc), str(exc)) if exc is not None else (None, None)
        if isinstance(exc, KeyError):
            message = str(exc.args[0]) if exc.args else message
        self.outbox.send(ipc.encode(ipc.Reply(call_id, value, kind, message, self.state())))

    def reply_all(self, call_ids: list[int], value: Any) -> None:
        for call_id in call_ids:
            self.reply(call_id, value)
        call_ids.clear()

    def off_loop(self, call_id: int, work: Callable[[], Any], commit: Callable[[Any], Any]) -> object:
        """Run `work` in the helper thread, then `commit(its result)` between two steps; reply with that."""

        def run() -> None:
            try:
                staged = work()
            except Exception as exc:
                self.done.put(lambda error=exc: self.reply(call_id, None, error))
                return
            self.done.put(lambda: self._commit(call_id, commit, staged))

        self.helper.submit(run)
        return DEFERRED

    def _commit(self, call_id: int, commit: Callable[[Any], Any], staged: Any) -> None:
        try:
            value = commit(staged)
        except Exception as exc:
            self.reply(call_id, None, exc)
        else:
            self.reply(call_id, value)

    # ---- named operations (the only ones the server can ask for) ------------------------------

    def op_pause(self, call_id: int, mode: str) -> object:
        aborted = self.pause.begin(self.engine, mode)
        self.reply_all(self.stepping, None)  # a step-limited resume cut short: the engine is frozen already
        if aborted is None:  # wait: replied once nothing is in flight
            self.drains.append(call_id)
            return DEFERRED
        return aborted

    def op_resume(self, call_id: int, steps: int | None = None) -> object:
        if getattr(self, "asleep", None):
            raise RuntimeError("the engine is asleep: POST /wake_up first")
        self.reply_all(self.stepping, None)
        if self.pause.resume(self.engine, steps) or steps is None:
            return None
        self.stepping.append(call_id)  # replied after the last step
        return DEFERRED

    def on_ranks(self, call_id: int, kind: str, args: list[Any], local: Callable[[], Any]) -> Any:
        """`local()` on rank 0; under tensor parallelism the workers stage the same work meanwhile."""
        tp = self.engine.tp
        return local() if tp is None else tp.staged(call_id, kind, args, local)

    def commit_on_ranks(self, call_id: int, commit: Callable[[], Any]) -> Any:
        """Commit rank 0's staged work, and the workers' before their next step."""
        if self.engine.tp is not None:
            self.engine.tp.commit(call_id)
        return commit()

    def op_update_from_dir(
        self, call_id: int, weight_dir: str, roots: list[str], label: str | None, inflight: str | None = None
    ) -> object:
        model = self.engine.model
        return self.off_loop(
            call_id,
            lambda: self.on_ranks(
                call_id,
                "dir",
                [weight_dir, roots],
                lambda: stage_from_dir(model, check_under_roots(weight_dir, roots), self.staging, roots),
            ),
            lambda staged: self.commit_on_ranks(call_id, lambda: self.engine.commit_weights(staged, label, inflight)),
        )

    def op_init_broadcaster(self, call_id: int, host: str, port: int, rank: int, world: int, timeout: float) -> object:
        from rlserve import weight_transfer
        from rlserve.engine.broadcast_group import leave_earlier_group

        earlier, peer = self.group, self.group_peer

        def join(_: None) -> None:
            self.group, self.group_peer = (
                ThreadPoolExecutor(1, thread_name_prefix="rlserve-group").submit(
                    weight_transfer.init_group, host, port, rank, world, timeout
                ),
                f"{host}:{port}",
            )

        return self.off_loop(call_id, lambda: leave_earlier_group(earlier, peer), join)

    def op_update_from_broadcast(self, call_id: int, label: str | None, inflight: str | None = None) -> object:
        from rlserve.engine.broadcast_group import receive_push

        if self.group is None:
            raise RuntimeError("no broadcaster: call /init_broadcaster first")
        group, model = self.group, self.engine.model
        device = "cuda" if self.engine.device.type == "cuda" else "cpu"

        def receive():
            group.result()
            staged = stage(model, receive_push(device, self.staging), "broadcast", require_all=False)
            if self.engine.tp is not None:  # each worker gets its slices of the validated tensors
                self.engine.tp.push(call_id, staged.tensors)
            return staged

        return self.off_loop(
            call_id,
            receive,
            lambda staged: self.commit_on_ranks(call_id, lambda: self.engine.commit_weights(staged, label, inflight)),
        )

    def op_load_adapter(self, call_id: int, name: str, path: str, roots: list[str]) -> object:
        from rlserve.model.lora import load_peft_adapter
        from rlserve.model.tensor_parallel import shard_adapter

        e, tp = self.engine, self.engine.config.parallel.tp

        def load():
            adapter = load_peft_adapter(name, check_under_roots(path, roots), e.shape, e.dtype, e.device, roots)
            return shard_adapter(adapter, 0, tp)

        return self.off_loop(
            call_id,
            lambda: self.on_ranks(call_id, "adapter", [name, path, roots], load),
            lambda adapter: self.commit_on_ranks(call_id, lambda: e.add_adapter(adapter)),
        )

    def op_remove_adapter(self, call_id: int, name: str) -> int:
        if name not in self.engine.adapters:
            raise KeyError(f"adapter {name!r} is not loaded")
        if self.engine.tp is not None:
            self.engine.tp.remove_adapter(name)
        return self.engine.remove_adapter(name)

    def op_set_weight_version(self, call_id: int, label: str, abort_all: bool) -> int:
        aborted = self.engine.abort_all() if abort_all else 0
        self.engine.weight_version = label
        return aborted

    def op_set_versions(self, call_id: int, policy_version: int, label: str) -> None:
        self.engine.policy_version, self.engine.weight_version = policy_version, label

    def op_has_unfinished(self, call_id: int) -> bool:
        return self.engine.has_unfinished()

    def op_abort(self, call_id: int, request_ids: list[str] | None) -> int:
        if request_ids is None:
            return self.engine.abort_all()
        return sum(self.engine.abort(str(i)) for i in request_ids)

    def op_reset_prefix_cache(self, call_id: int) -> bool:
        return self.engine.pool.reset_prefix_cache()

    def op_snapshot(self, call_id: int) -> None:
        return None


DEFERRED = object()  # the operation replies later (helper thread, or pause waiting for a drain)
OPS: dict[str, Callable[..., Any]] = {name[3:]: fn for name, fn in vars(EngineCore).items() if name.startswith("op_")}
OPS.update(vllm_receiver.OPS)  # vLLM's weight-transfer routes, received in this process
OPS.update(sleep.OPS)  # vLLM's sleep mode
OPS.update(weight_snapshot.OPS)  # a deployment's copy of pushed weights


def _run_in_thread(fn: Callable[[], None]) -> None:
    """Run the step loop in a thread, as the in-thread engine does: measured on a loaded 2-core machine,
    the same loop on the process's main thread stepped ~10x slower (OpenMP waits in every matmul)."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=target, name="rlserve-engine")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def main(argv: list[str]) -> int:
    """`python -m rlserve.runtime.core IN_ADDR OUT_ADDR`, the config as JSON on stdin (a spawned core)."""
    in_addr, out_addr = argv
    # SIGTERM (the server going away) ends the loop at once (_serve); SIGINT is the server's to handle
    config = child.start_child()
    if config is None:
        return 1
    return _connect_and_serve(config, in_addr, out_addr)


def main_forked(config: Config, in_addr: str, out_addr: str, parent: int) -> int:
    """The core in a child forked from the server (runtime/spawn.py) after it imported this module: what the
    spawned core's interpreter starts without (the server's signal handlers, its stdin, its parent's name)
    is set here."""
    if not child.as_forked_child(parent, f"rlserve.runtime.core {in_addr} {out_addr}"):  # ps tells it from the server
        return 1
    configure_logging(config)
    return _connect_and_serve(config, in_addr, out_addr)


def _connect_and_serve(config: Config, in_addr: str, out_addr: str) -> int:
    tp_forked.fork_waiting_workers(config)  # before ZeroMQ's I/O thread and the first torch op
    inbox, outbox = child.connect_pair(zmq.Context(), in_addr, out_addr, 1000)
    try:
        return _serve(config, inbox, outbox)
    finally:
        inbox.close(linger=0)
        outbox.close(linger=2000)  # the last message (a failure) still reaches the server
        tp_forked.release()


def _serve(config: Config, inbox: zmq.Socket, outbox: zmq.Socket) -> int:
    try:
        engine = Engine(config)
    except Exception as exc:  # config checks say what to change; the server prints it
        outbox.send(ipc.encode(ipc.Failed(str(exc) if isinstance(exc, ValueError) else repr(exc))))
        return 1
    core = EngineCore(engine, inbox, outbox)
    freeze_startup_heap()
    outbox.send(
        ipc.encode(
            ipc.Ready(
                str(engine.model_dir),
                engine.max_model_len,
                engine.vocab_size,
                {f.name: getattr(engine.shape, f.name) for f in dataclasses.fields(engine.shape)},
                core.state(),
            )
        )
    )
    # SIGTERM ends the loop between two steps, so the engine still closes (the KV disk tier's files)
    signal.signal(signal.SIGTERM, lambda *_: setattr(core, "stop", True))
    try:
        _run_in_thread(core.run)
    except BaseException as exc:
        log.exception("engine core died")
        reason = engine.tp.explain(exc) if engine.tp is not None else repr(exc)
        outbox.send(ipc.encode(ipc.Failed(f"engine core died: {reason}")))
        return 1
    finally:
        core.helper.shutdown(wait=False, cancel_futures=True)
        engine.close()
    return 0


if __name__ == "__main__":
    # exit without waiting for helper threads (a trainer group that never formed)
    code = main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)
