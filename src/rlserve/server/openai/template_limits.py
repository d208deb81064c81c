"""Bounds on rendering a request-supplied chat template (only with server.trust_request_chat_template).

HF renders templates in a jinja sandbox, which stops escapes but not loops that run for minutes or
expand to gigabytes. Rendering runs in the server's tokenizer thread; there a trace function stops
it at a deadline (templates compile to Python, so every loop iteration passes it), and the rendered
prompt is capped before it reaches the engine. A single huge C-level string operation between two
checks is the one thing the deadline cannot interrupt.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

RENDER_SECONDS = 2.0
MAX_RENDERED_TOKENS = 1 << 20


class RenderLimitError(Exception):
    pass


@contextlib.contextmanager
def bounded_render(seconds: float = RENDER_SECONDS) -> Iterator[None]:
    deadline = time.monotonic() + seconds

    def trace(frame, event, arg):
        if time.monotonic() > deadline:
            raise RenderLimitError(f"took longer than {seconds:g} s to render; simplify it")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)
