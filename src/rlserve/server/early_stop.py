"""A SIGTERM that comes while a server is still starting, remembered as well as raised.

Until the HTTP server takes SIGTERM over (its drain), the signal unwinds startup as SystemExit, so an
engine process already started is stopped. But a SystemExit raised at an arbitrary point can be
swallowed by code that catches BaseException (an import's fallback, a library's cleanup); then the
signal would be lost and the server would go on to serve. So it is also recorded here, and checked
again where the HTTP server takes over: a recorded signal stops the server there, or drains it.
Light imports only: rlserve.cli installs the handler before importing the server stack.
"""

from __future__ import annotations

from typing import NoReturn

requested: int | None = None  # the signal received while starting, if any


def on_signal(signum: int, frame) -> NoReturn:
    global requested
    requested = signum
    raise SystemExit(128 + signum)


def check() -> None:
    """Raise the SystemExit of a signal received earlier, should its first one have been swallowed."""
    if requested is not None:
        raise SystemExit(128 + requested)
