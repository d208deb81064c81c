"""The API server's handle on an engine core process (runtime/core.py), with AsyncEngine's face.

Requests and named control operations go out over one ZeroMQ socket; outputs, replies and the
engine's state come back over another. Both are `ipc://` sockets in a private directory, never
a network port. If the process dies, every waiting request and call fails with EngineDeadError
within a fraction of a second and `dead` says why.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from transformers import AutoTokenizer

from rlserve.config.schema import Config
from rlserve.engine.error_kinds import rebuild_error
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.engine.stats import EngineStats
from rlserve.engine.wire_ints import wire_safe
from rlserve.model.shape import ModelShape
from rlserve.runtime import ipc, output_delta
from rlserve.runtime.face import (
    EngineDeadError,
    EngineUnavailableError,
    FaceRules,
    check_pause_mode,
    check_steps,
    dead_error,
    relay_outputs,
)
from rlserve.runtime.spawn import EngineProcess

log = logging.getLogger(__name__)
WATCH_INTERVAL_S = 0.2  # how often the process is checked for an exit no message announced


class EngineClient(FaceRules):
    def __init__(self, config: Config, wait: bool = True, process: EngineProcess | None = None, fork: bool = False):
        """Start the engine process (forked from this one with `fork`: see EngineProcess), or adopt `process`
        started earlier for this config (rlserve.cli starts it before importing the server stack); with
        wait=False call `wait_ready()` before use (engines start side by side)."""
        super().__init__()
        self.config = config
        self.process = process if process is not None else EngineProcess(config, fork)
        self.proc, self._out, self._in = self.process.proc, self.process.to_engine, self.process.from_engine
        self._streams: dict[int, asyncio.Queue] = {}
        self._last: dict[int, RequestOutput] = {}  # key -> its latest cumulative output, which deltas continue
        self._calls: dict[int, asyncio.Future] = {}
        self._keys = itertools.count()
        self._tasks: list[asyncio.Task] = []
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine has loaded its model; ValueError with its message if it could not."""
        try:
            ready = self._wait_ready()
        except BaseException:
            self.process.stop()  # still loading: it reads no Shutdown message yet, so it is terminated
            raise
        config = self.config
        self.model_dir = Path(ready.model_dir)
        self.max_model_len, self.vocab_size = ready.max_model_len, ready.vocab_size
        self.shape = ModelShape.from_dict(ready.shape)
        self._state = ready.state
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir, trust_remote_code=config.model.trust_remote_code)

    def _wait_ready(self) -> ipc.Ready:
        while True:
            if self._in.poll(200):
                msg = ipc.to_server.decode(self._in.recv())
                if isinstance(msg, ipc.Failed):
                    raise ValueError(msg.message)
                if isinstance(msg, ipc.Ready):
                    return msg
            elif self.proc.poll() is not None:
                raise RuntimeError(f"the engine process exited with code {self.proc.returncode} while starting")

    # ---- what the server reads without asking (refreshed by every reply) --------------------

    @property
    def policy_version(self) -> int:
        return self._state.policy_version

    @property
    def weight_version(self) -> str:
        return self._state.weight_version

    @property
    def adapters(self) -> dict[str, str]:
        return self._state.adapters

    @property
    def paused(self) -> bool:
        return self._state.paused

    @property
    def stats(self) -> EngineStats:
        return msgspec.convert(self._state.stats, EngineStats)

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Start reading the engine's messages in the running event loop (the app's startup)."""
        if self._tasks:
            return
        self._ain = zmq.asyncio.Socket.from_socket(self._in)
        self._tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._watch())]

    async def _read(self) -> None:
        try:
            while True:
                self._handle(ipc.to_server.decode(await self._ain.recv()))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:  # a bug on one side: fail loudly
            self._fail(RuntimeError(f"undecodable message from the engine: {exc}"))

    def _handle(self, msg: ipc.ToServer) -> None:
        if isinstance(msg, ipc.Outputs):
            self._state = msg.state
            for delta in msg.items:
                queue = self._streams.get(delta.key)
                if queue is None:  # aborted here while the engine stepped it
                    continue
                out = output_delta.merge(delta.output, delta.starts, delta.prompt_kept, self._last.get(delta.key))
                if out.finished:
                    self._last.pop(delta.key, None)
                else:
                    self._last[delta.key] = out
                queue.put_nowait(out)
        elif isinstance(msg, ipc.Reply):
            self._state = msg.state
            fut = self._calls.pop(msg.call_id, None)
            if fut is not None and not fut.done():
                if msg.error_kind is None:
                    fut.set_result(msg.value)
                else:
                    fut.set_exception(rebuild_error(msg.error_kind, msg.error))
        elif isinstance(msg, ipc.Rejected):
            queue = self._streams.get(msg.key)
            if queue is not None:
                queue.put_nowait((EngineUnavailableError if msg.unavailable else ValueError)(msg.message))
        elif isinstance(msg, ipc.Failed):
            self._fail(RuntimeError(msg.message))

    async def _watch(self) -> None:
        while self.proc.poll() is None:
            await asyncio.sleep(WATCH_INTERVAL_S)
        code = self.proc.returncode
        # the core exits 0 only when asked to: Shutdown, or a SIGTERM to the whole process group during a stop
        self._fail(RuntimeError(f"engine process exited with code {code}"), asked=code == 0)

    def _fail(self, exc: BaseException, asked: bool = False) -> None:
        if self.dead is None:
            (log.info if asked else log.error)("engine core is gone: %s", exc)
            self.dead = exc
        err = dead_error(self.dead)
        for queue in self._streams.values():
            queue.put_nowait(err)
        for fut in self._calls.values():
            if not fut.done():
                fut.set_exception(err)
        self._calls.clear()

    def shutdown(self) -> None:
        """Ask the core to stop, then make sure it has: nothing is left behind."""
        if self.process.stopped:
            return
        self.process.stop(ipc.encode(ipc.Shutdown()))
        for task in self._tasks:
            task.cancel()

    # ---- requests ---------------------------------------------------------------------------

    def _send(self, msg: Any) -> None:
        """EngineDeadError when no engine is connected any more: it exited (a SIGTERM to the whole process
        group reaches it too), and _watch has not noticed yet. Sockets without high-water marks never
        refuse a message otherwise."""
        try:
            self._out.send(ipc.encode(msg), zmq.NOBLOCK)
        except zmq.Again:
            raise EngineDeadError("engine loop died: the engine process has closed its socket") from None

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """As AsyncEngine.generate: cumulative outputs, the last finished; ValueError for bad input."""
        self._check_alive()
        params = wire_safe(prompt, params, self.vocab_size, self.config.engine.max_logprobs)
        key = next(self._keys)
        self._send(ipc.Add(key, request_id, prompt, params, cache_salt, adapter, stream))
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[key] = outputs  # before any output can be read: that happens at our first await

        def abort_unless_dead() -> None:
            self._streams.pop(key, None)
            self._last.pop(key, None)
            if self.dead is None:
                with contextlib.suppress(EngineDeadError):  # gone: nothing left to abort
                    self._send(ipc.Abort(key))

        async for out in relay_outputs(outputs, abort_unless_dead):
            if out.finished:
                self._streams.pop(key, None)
            yield out

    async def _call(self, op: str, *args: Any) -> Any:
        self._check_alive()
        call_id = next(self._keys)
        self._send(ipc.Call(call_id, op, list(args)))
        fut = self._calls[call_id] = asyncio.get_running_loop().create_future()  # the reply is read after we await
        return await fut

    # ---- named control operations (core.OPS) ------------------------------------------------

    async def control(self, op: str, *args: Any) -> Any:
        """Any named operation of core.OPS (engine/vllm_receiver.py's are reached this way)."""
        return await self._call(op, *args)

    async def refresh(self) -> None:
        """Bring `stats` and the other mirrored facts up to date (a dead engine keeps its last ones)."""
        if self.dead is None:
            await self._call("snapshot")

    async def abort(self, request_id: str) -> int:
        return await self._call("abort", [request_id])

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        """Abort these ids, or every request when None; returns how many."""
        return await self._call("abort", None if request_ids is None else [str(i) for i in request_ids])

    async def pause(self, mode: str = "keep") -> int:
        check_pause_mode(mode)
        return await self._call("pause", mode)

    async def resume(self, steps: int | None = None) -> None:
        check_steps(steps)
        await self._call("resume", steps)

    async def reset_prefix_cache(self) -> bool:
        return await self._call("reset_prefix_cache")

    async def update_weights_from_dir(
        self,
        weight_dir: str,
        roots: list[str],
        weight_version: str | None = None,
        started: asyncio.Event | None = None,
        inflight: str | None = None,
    ) -> int:
        async with self._update_turn(started):
            return await self._call("update_from_dir", weight_dir, roots, weight_version, inflight)

    async def init_broadcaster(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None:
        await self._call("init_broadcaster", host, port, rank, world_size, timeout_s)

    async def update_weights_from_broadcast(
        self, weight_version: str | None = None, started: asyncio.Event | None = None, inflight: str | None = None
    ) -> int:
        async with self._update_turn(started):
            return await self._call("update_from_broadcast", weight_version, inflight)

    async def set_versions(self, policy_version: int, label: str) -> None:
        await self._call("set_versions", policy_version, label)

    async def has_unfinished(self) -> bool:
        return await self._call("has_unfinished")

    async def load_adapter(self, name: str, path: str, roots: list[str]) -> int:
        return await self._call("load_adapter", name, path, roots)

    async def remove_adapter(self, name: str) -> int:
        return await self._call("remove_adapter", name)

    async def set_weight_version(self, label: str, abort_all: bool = False) -> int:
        return await self._call("set_weight_version", label, abort_all)
