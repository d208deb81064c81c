"""What each pause mode does to an engine, written once for both hosts of the step loop: the in-thread
AsyncEngine (runtime/inproc.py) and the engine core process (runtime/core.py). Every method runs on the
engine's own thread, between two steps.

- keep: freeze in-flight requests where they are;
- abort: finish them now (their outputs say `abort`);
- wait: admit nothing new and let the running ones finish, then freeze.

New requests queue in every mode; resume lets everything run again, or, given a number of steps, runs that
many engine steps and freezes again as `keep` does: a paused server advanced a known amount, so what happens
between two control calls is fixed by construction rather than by how fast the machine steps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlserve.runtime.face import check_pause_mode, check_steps

if TYPE_CHECKING:
    from rlserve.engine.engine import Engine


class PauseState:
    def __init__(self) -> None:
        self.paused = False
        self.until_step: int | None = None  # a step-limited resume freezes the engine once it has run this many

    def begin(self, engine: Engine, mode: str) -> int | None:
        """Apply `mode`: the number of requests aborted, or None for `wait` (then `drained` says when it is done)."""
        check_pause_mode(mode)
        self.until_step = None
        if mode == "abort":
            self.paused = True
            return engine.abort_all()
        if mode == "wait":  # from a frozen engine too: the running ones must run to finish
            engine.scheduler.hold_new = True
            self.paused = False
            return None
        self.paused = True
        return 0

    def drained(self, engine: Engine) -> bool:
        """A `wait` pause is done once nothing is in flight: the engine is then paused."""
        if engine.scheduler.num_in_flight():
            return False
        self.paused = True
        return True

    def resume(self, engine: Engine, steps: int | None = None) -> bool:
        """Let the engine run: for good, or for `steps` steps. True when a step-limited resume is already over
        (nothing is in flight to step), so its caller replies now rather than after the last step."""
        check_steps(steps)
        engine.scheduler.hold_new = False
        self.paused = False
        self.until_step = None if steps is None else engine.scheduler.stats.num_steps + steps
        return steps is not None and self.stepped(engine)

    def stepped(self, engine: Engine) -> bool:
        """On every turn of the step loop: True when a step-limited resume has just ended (the engine is frozen
        again). A step counts when it ran a batch; with nothing left in flight the resume is over whatever its
        count."""
        if self.until_step is None:
            return False
        if engine.scheduler.stats.num_steps < self.until_step and engine.has_unfinished():
            return False
        self.paused, self.until_step = True, None
        return True
