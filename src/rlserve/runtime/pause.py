"""What each pause mode does to an engine, written once for both hosts of the step loop: the in-thread
AsyncEngine (runtime/inproc.py) and the engine core process (runtime/core.py). Every method runs on the
engine's own thread, between two steps.

- keep: freeze in-flight requests where they are;
- abort: finish them now (their outputs say `abort`);
- wait: admit nothing new and let the running ones finish, then freeze.

New requests queue in every mode; resume lets everything run again.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.runtime.face import check_pause_mode

if TYPE_CHECKING:
    from rlserve.engine.engine import Engine


class PauseState:
    def __init__(self) -> None:
        self.paused = False

    def begin(self, engine: Engine, mode: str) -> int | None:
        """Apply `mode`: the number of requests aborted, or None for `wait` (then `drained` says when it is done)."""
        check_pause_mode(mode)
        if mode == "abort":
            self.paused = True
            return engine.abort_all()
        if mode == "wait":
            engine.scheduler.hold_new = True
            return None
        self.paused = True
        return 0

    def drained(self, engine: Engine) -> bool:
        """A `wait` pause is done once nothing is in flight: the engine is then paused."""
        if engine.scheduler.num_in_flight():
            return False
        self.paused = True
        return True

    def resume(self, engine: Engine) -> None:
        engine.scheduler.hold_new = False
        self.paused = False
