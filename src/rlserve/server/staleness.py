"""Staleness held back, not refused: async-RL admission by policy version.

A request may say which policy it needs: `min_policy_version`, or the trainer's own
`policy_version` with the server's `server.max_off_policy_steps` (the server may be at most that
many versions behind the trainer: 1 is the one-step off-policy pattern). When the server is not
there yet, the request waits for the update (up to `policy_wait_s`, per request or
`server.policy_wait_s`) and then runs on the new weights; past the wait it gets 409 naming the
server's current version (also in the X-Policy-Version header). The upper bounds of the window
(max_policy_version, max_staleness) are checked as before: waiting cannot make a newer server older.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from rlserve.server.errors import APIError

POLL_S = 0.02


def required_version(state, fields: dict[str, Any]) -> int | None:
    """The oldest policy version the request may start on, or None when it names none."""
    low = fields.get("min_policy_version")
    steps, trainer = state.config.server.max_off_policy_steps, fields.get("policy_version")
    if steps is not None and trainer is not None:
        floor = int(trainer) - steps
        low = floor if low is None else max(int(low), floor)
    return low


async def hold_for_policy_version(state, fields: dict[str, Any]) -> None:
    """Wait (bounded) until the server serves the version the request needs, then check its window."""
    low = required_version(state, fields)
    if low is not None and state.engine.policy_version < low:
        wait = fields.get("policy_wait_s")
        wait = state.config.server.policy_wait_s if wait is None else float(wait)
        deadline = time.monotonic() + wait
        while state.engine.policy_version < low and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        current = state.engine.policy_version
        if current < low:
            why = "min_policy_version" if fields.get("min_policy_version") == low else "policy_version"
            raise APIError(409, f"server policy_version {current} is older than the {low} this request needs "
                           f"({why}; waited {wait:g} s for an update): retry later or raise policy_wait_s",
                           param=why, type="ConflictError", headers={"X-Policy-Version": str(current)})  # fmt: skip
    state.check_policy_version(fields)
