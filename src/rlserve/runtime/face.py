"""What the server's three engine faces share: AsyncEngine (in-thread), EngineClient (its own
process) and DataParallelClient (k processes).

Weight updates queue on one update lock per engine, so each is staged and committed whole;
`started` tells the caller its update holds the lock (control.py drops an update whose caller
left before then).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

PAUSE_MODES = ("keep", "abort", "wait")


class EngineDeadError(RuntimeError):
    pass


class EngineFace:
    dead: BaseException | None = None  # why the engine stopped; every later call raises EngineDeadError

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
            raise EngineDeadError(f"engine loop died: {self.dead!r}")


def check_pause_mode(mode: str) -> None:
    if mode not in PAUSE_MODES:
        raise ValueError(f"mode must be keep, abort or wait, got {mode!r}")
