"""What the server does when its engine dies under it (the core process killed, its step loop crashed).

Every request in flight has already ended with a 503 naming the cause (the engine client fails them
the moment it notices). The server then refuses new work, stops, and exits with ENGINE_DIED_EXIT_CODE,
so that whatever supervises it (a deployment's supervisor, systemd, Kubernetes) starts a fresh replica,
which a deployment brings to its current weights before traffic reaches it. Restarting the engine in
place is not done: weights pushed by a trainer exist nowhere but in the dead process (docs/faults.md).
"""

from __future__ import annotations

import contextlib
import logging

log = logging.getLogger("rlserve.server")
ENGINE_DIED_EXIT_CODE = 3


async def engine_died(state) -> int:
    """Start the stop of a server whose engine is dead; the code it exits with. Under parallel.dp the other
    engines' requests are aborted (finish_reason "abort") rather than cut off when the server stops."""
    log.error(
        "the engine is gone (%r): in-flight requests got 503; stopping with exit code %d so the "
        "supervisor starts a fresh replica",
        state.engine.dead,
        ENGINE_DIED_EXIT_CODE,
    )
    state.draining = True
    for engine in getattr(state.engine, "engines", []):
        if engine.dead is None:
            with contextlib.suppress(Exception):  # it may die too on the way: the server stops regardless
                await engine.abort_requests()
    return ENGINE_DIED_EXIT_CODE
