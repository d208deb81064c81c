"""The asyncio face of the engine: the engine steps in its own thread; the event loop never waits on it.

Everything that touches engine state runs in the engine thread between steps: requests are
submitted and aborted through a command queue, control operations run there as callables.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.engine.sequence import Request
from rlserve.engine.weights import StagingBuffers, check_under_roots, stage, stage_from_dir
from rlserve.runtime.face import FaceRules, check_pause_mode, dead_error, relay_outputs
from rlserve.runtime.pause import PauseState

log = logging.getLogger(__name__)
T = TypeVar("T")


class AsyncEngine(FaceRules):
    def __init__(self, config: Config | None = None, engine: Engine | None = None):
        super().__init__()
        self.engine = engine or Engine(config)
        self._commands: queue.SimpleQueue[Callable[[Engine], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        if self.engine.kv_transfer is not None:  # a landed pull wakes the loop; it never polls for one
            self.engine.kv_transfer.wake = self._wake.set
        # id(request) -> (loop, queue, every step's output wanted, first output sent)
        self._streams: dict[int, list] = {}
        self._stop = False
        self._pause = PauseState()
        # a step-limited resume's callers, answered on the engine thread once its last step ran
        self._stepping: list[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = []
        self._group: asyncio.Future | None = None  # torch.distributed group with a trainer
        self._group_peer: str | None = None  # that trainer's host:port
        self._staging = StagingBuffers()  # reused by every update; the lock keeps one in flight
        self._thread = threading.Thread(target=self._loop, name="rlserve-engine", daemon=True)
        self._thread.start()

    # the engine's read-only facts, for the server
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    # the same face as EngineClient (engine in its own process): what the server reads and asks for
    @property
    def config(self) -> Config:
        return self.engine.config

    @property
    def model_dir(self):
        return self.engine.model_dir

    @property
    def shape(self):
        return self.engine.shape

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    @property
    def weight_version(self) -> str:
        return self.engine.weight_version

    @property
    def adapters(self) -> dict[str, str]:
        return {name: a.path for name, a in self.engine.adapters.items()}

    @property
    def stats(self):
        return self.engine.stats

    async def start(self) -> None:
        pass

    async def refresh(self) -> None:
        pass

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        if request_ids is None:
            return await self.call(lambda e: e.abort_all())
        return await self.call(lambda e: sum(e.abort(str(i)) for i in request_ids))

    async def reset_prefix_cache(self) -> bool:
        return await self.call(lambda e: e.pool.reset_prefix_cache())

    async def load_adapter(self, name: str, path: str, roots: list[str]) -> int:
        from rlserve.model.lora import load_peft_adapter

        e = self.engine
        adapter = await asyncio.to_thread(
            lambda: load_peft_adapter(name, check_under_roots(path, roots), e.shape, e.dtype, e.device, roots)
        )
        return await self.call(lambda e: e.add_adapter(adapter))

    async def set_versions(self, policy_version: int, label: str) -> None:
        def run(e: Engine) -> None:
            e.policy_version, e.weight_version = policy_version, label

        await self.call(run)

    async def has_unfinished(self) -> bool:
        return await self.call(Engine.has_unfinished)

    async def remove_adapter(self, name: str) -> int:
        if name not in self.engine.adapters:
            raise KeyError(f"adapter {name!r} is not loaded")
        return await self.call(lambda e: e.remove_adapter(name))

    async def set_weight_version(self, label: str, abort_all: bool = False) -> int:
        def relabel(e: Engine) -> int:
            aborted = e.abort_all() if abort_all else 0
            e.weight_version = label
            return aborted

        return await self.call(relabel)

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
        """Yields the cumulative output after every step that touched the request (stream=False:
        only the first and the last); the last has finished=True. Raises ValueError for bad input
        before yielding. Leaving the iteration early (client gone, task cancelled) aborts the
        request and frees its blocks."""
        self._check_alive()
        req = self.engine.make_request(request_id, prompt, params, cache_salt=cache_salt, adapter=adapter)
        outputs: asyncio.Queue = asyncio.Queue()
        self._streams[id(req)] = [asyncio.get_running_loop(), outputs, stream, False]
        self._post(lambda e: e.submit(req))

        def abort_unless_dead() -> None:
            self._streams.pop(id(req), None)
            if self.dead is None:
                self._post(lambda e: e.abort_request(req))

        async for out in relay_outputs(outputs, abort_unless_dead):
            if out.finished:
                self._streams.pop(id(req), None)
            yield out

    async def abort(self, request_id: str) -> int:
        return await self.call(lambda e: e.abort(request_id))

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run fn(engine) in the engine thread between two steps and return its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def run(engine: Engine) -> None:
            try:
                result = fn(engine)
            except BaseException as exc:  # handed to the caller, not swallowed
                loop.call_soon_threadsafe(_set_exception, fut, exc)
            else:
                loop.call_soon_threadsafe(_set_result, fut, result)

        self._post(run)
        return await fut

    # ---- control plane: every mutation lands between two engine steps ----------------------

    @property
    def paused(self) -> bool:
        return self._pause.paused

    async def pause(self, mode: str = "keep") -> int:
        """The modes are runtime/pause.py's. Returns how many requests were aborted."""
        check_pause_mode(mode)
        aborted = await self.call(lambda e: self._begin_pause(e, mode))
        while aborted is None and not await self.call(self._pause.drained):
            await asyncio.sleep(0.01)
        return aborted or 0

    def _begin_pause(self, engine: Engine, mode: str) -> int | None:
        aborted = self._pause.begin(engine, mode)
        self._end_stepping()  # a step-limited resume cut short: the engine is frozen already
        return aborted

    async def resume(self, steps: int | None = None) -> None:
        """Returns once the engine runs; with `steps`, once it has run them and is frozen again."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def start(engine: Engine) -> None:
            self._end_stepping()  # an earlier step-limited resume is over: this one replaces it
            if self._pause.resume(engine, steps) or steps is None:
                loop.call_soon_threadsafe(_set_result, done, None)
            else:
                self._stepping.append((loop, done))

        await self.call(start)
        await done

    def _end_stepping(self, exc: BaseException | None = None) -> None:
        """Answer the waiting resumes (on the engine thread)."""
        for loop, fut in self._stepping:
            if exc is None:
                loop.call_soon_threadsafe(_set_result, fut, None)
            else:
                loop.call_soon_threadsafe(_set_exception, fut, exc)
        self._stepping.clear()

    async def update_weights_from_dir(
        self,
        weight_dir: str,
        roots: list[str],
        weight_version: str | None = None,
        started: asyncio.Event | None = None,
        inflight: str | None = None,
    ) -> int:
        """Read and validate off the engine thread, then swap between two steps. Returns the new version."""
        path = check_under_roots(weight_dir, roots)
        async with self._update_turn(started):
            staged = await asyncio.to_thread(stage_from_dir, self.engine.model, path, self._staging, roots)
            return await self.call(lambda e: e.commit_weights(staged, weight_version, inflight))

    async def init_broadcaster(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None:
        """Join the trainer's group in the background: the trainer joins whenever it is ready."""
        from rlserve import weight_transfer
        from rlserve.engine.broadcast_group import leave_earlier_group

        await asyncio.to_thread(leave_earlier_group, self._group, self._group_peer)
        self._group_peer = f"{host}:{port}"
        self._group = asyncio.ensure_future(
            asyncio.to_thread(weight_transfer.init_group, host, port, rank, world_size, timeout_s)
        )

    async def update_weights_from_broadcast(
        self, weight_version: str | None = None, started: asyncio.Event | None = None, inflight: str | None = None
    ) -> int:
        """Receive one push from the trainer (all of it, even if invalid, so the group stays in
        step), validate, then swap between two steps. Returns the new version."""
        from rlserve.engine.broadcast_group import receive_push

        if self._group is None:
            raise RuntimeError("no broadcaster: call /init_broadcaster first")
        await self._group
        device = "cuda" if self.engine.device.type == "cuda" else "cpu"
        async with self._update_turn(started):
            received = await asyncio.to_thread(receive_push, device, self._staging)
            staged = stage(self.engine.model, received, "broadcast", require_all=False)
            return await self.call(lambda e: e.commit_weights(staged, weight_version, inflight))

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=10)
        self.engine.close()

    # ---- engine thread ----------------------------------------------------------------------

    def _post(self, command: Callable[[Engine], None]) -> None:
        self._check_alive()
        self._commands.put(command)
        self._wake.set()

    def _loop(self) -> None:
        engine = self.engine
        try:
            while not self._stop:
                self._wake.clear()
                while True:
                    try:
                        self._commands.get_nowait()(engine)
                    except queue.Empty:
                        break
                engine.poll_transfers()
                if self._pause.stepped(engine):  # a step-limited resume's count reached, or nothing left to step
                    self._end_stepping()
                idle_s = 0.05 if engine.kv_transfer is not None else 0.5  # pins time out between two looks
                if self._pause.paused:
                    self._dispatch(engine.take_pending())
                    self._wake.wait(timeout=idle_s)
                elif engine.has_unfinished():
                    self._dispatch(engine.step_requests())
                    hold_s = engine.scheduler.admission_delay()  # a batch-forming window: wait for more
                    if hold_s > 0:
                        self._wake.wait(timeout=hold_s)
                else:
                    self._wake.wait(timeout=idle_s)
        except BaseException as exc:
            log.exception("engine loop died")
            self.dead = exc
            self._end_stepping(dead_error(exc))
            for loop, stream, *_ in list(self._streams.values()):
                loop.call_soon_threadsafe(stream.put_nowait, dead_error(exc))

    def _dispatch(self, touched: list[Request]) -> None:
        for req in touched:
            target = self._streams.get(id(req))
            if target is None:
                continue
            loop, stream, every_step, sent_first = target
            if every_step or not sent_first or req.finished:
                target[3] = True
                loop.call_soon_threadsafe(stream.put_nowait, req.output())


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
