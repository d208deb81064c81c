"""The one interface the server uses for any engine (`EngineFace`, a Protocol) and the rules every form of it
shares (`FaceRules`): AsyncEngine (in-thread, runtime/inproc.py), EngineClient (an engine core process,
runtime/proc_client.py) and DataParallelClient (k of them, runtime/data_parallel.py).

Weight updates queue on one update lock per engine, so each is staged and committed whole;
`started` tells the caller its update holds the lock (server/rl/control.py drops an update whose caller
left before then). Pause modes are checked here; what each mode does to the engine is runtime/pause.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rlserve.config.schema import Config
    from rlserve.engine.outputs import RequestOutput
    from rlserve.engine.params import SamplingParams
    from rlserve.engine.stats import EngineStats
    from rlserve.model.shape import ModelShape

PAUSE_MODES = ("keep", "abort", "wait")


class EngineDeadError(RuntimeError):
    pass


class EngineUnavailableError(RuntimeError):
    """The engine is alive but cannot run requests now (its weights released by sleep level 2): a 503."""


class EngineFace(Protocol):
    """What the server reads from an engine and asks of it. Every call is safe from the event loop; mutations
    land between two engine steps."""

    config: Config
    tokenizer: Any
    model_dir: Path
    shape: ModelShape
    max_model_len: int
    vocab_size: int
    dead: BaseException | None  # why the engine stopped; every later call raises EngineDeadError

    @property
    def policy_version(self) -> int: ...
    @property
    def weight_version(self) -> str: ...
    @property
    def adapters(self) -> dict[str, str]: ...
    @property
    def paused(self) -> bool: ...
    @property
    def updating(self) -> bool: ...
    @property
    def stats(self) -> EngineStats: ...

    async def start(self) -> None: ...
    def shutdown(self) -> None: ...
    async def refresh(self) -> None: ...

    def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]: ...

    async def abort(self, request_id: str) -> int: ...
    async def abort_requests(self, request_ids: list[str] | None = None) -> int: ...
    async def has_unfinished(self) -> bool: ...
    async def pause(self, mode: str = "keep") -> int: ...
    async def resume(self, steps: int | None = None) -> None:
        """Run again; with `steps`, only that many engine steps, returning once they ran and the engine is frozen."""

    async def reset_prefix_cache(self) -> bool: ...
    async def update_weights_from_dir(
        self,
        weight_dir: str,
        roots: list[str],
        weight_version: str | None = None,
        started: asyncio.Event | None = None,
        inflight: str | None = None,
    ) -> int: ...
    async def init_broadcaster(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None: ...
    async def update_weights_from_broadcast(
        self, weight_version: str | None = None, started: asyncio.Event | None = None, inflight: str | None = None
    ) -> int: ...
    async def set_versions(self, policy_version: int, label: str) -> None: ...
    async def set_weight_version(self, label: str, abort_all: bool = False) -> int: ...
    async def load_adapter(self, name: str, path: str, roots: list[str]) -> int: ...
    async def remove_adapter(self, name: str) -> int: ...


class FaceRules:
    """The control rules every EngineFace implementation inherits: one update lock, and death is final."""

    dead: BaseException | None = None

    def __init__(self) -> None:
        self._update_lock = asyncio.Lock()

    @property
    def updating(self) -> bool:
        """A weight update is being staged or committed."""
        return self._update_lock.locked()

    @asynccontextmanager
    async def _update_turn(self, started: asyncio.Event | None) -> AsyncIterator[None]:
        """Hold the update lock; `started` is set once it is held: cancelling before then changes nothing."""
        async with self._update_lock:
            if started is not None:
                started.set()
            yield

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise dead_error(self.dead)


async def relay_outputs(outputs: asyncio.Queue, on_early_exit: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """One request's stream as every face yields it: the engine's cumulative outputs, in the order they are
    put on `outputs`, up to the finished one; an exception put there is raised. Leaving early (client gone,
    task cancelled, engine dead) calls `on_early_exit`, which aborts the request and frees its blocks."""
    finished = False
    try:
        while not finished:
            out = await outputs.get()
            if isinstance(out, BaseException):
                raise out
            finished = out.finished
            yield out
    finally:
        if not finished:
            on_early_exit()


def dead_error(cause: BaseException) -> EngineDeadError:
    err = EngineDeadError(f"engine loop died: {cause!r}")
    err.__cause__ = cause
    return err


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be keep, abort or wait, got {mode!r}")


def check_steps(steps: int | None) -> None:
    """A step-limited resume's count (runtime/pause.py): None (run for good) or a whole number of at least 1."""
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ValueError(f"steps must be a whole number of at least 1, got {steps!r}")
