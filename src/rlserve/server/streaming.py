"""Running a route's engine requests: concurrently, cancelled (and so aborted in the engine) when the client goes
away, and streamed as server-sent events with errors as a final event."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse

from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.runtime.face import EngineDeadError
from rlserve.server.errors import APIError
from rlserve.server.limits import check_request_caps
from rlserve.server.request_metrics import timing
from rlserve.server.state import ServerState, engine_errors

T = TypeVar("T")
log = logging.getLogger(__name__)


class ClientGone(Exception):
    pass


async def until_disconnected(request: Request, aw: Awaitable[T]) -> T:
    """Await `aw`, cancelling it (and so aborting its engine requests) if the client goes away."""
    task = asyncio.ensure_future(aw)
    watch = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task not in done:
        raise ClientGone()
    return task.result()


async def _wait_disconnect(request: Request) -> None:
    # the body has been read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Run:
    """The engine requests of one HTTP request (one per prompt), consumed as one event stream."""

    def __init__(
        self,
        state: ServerState,
        prompts: list[list[int]],
        params: SamplingParams,
        rid: str,
        cache_salt: str | None,
        adapter: str | None = None,
        stream: bool = True,
    ):
        check_request_caps(state, params)
        self.state, self.n = state, params.n
        self._queue: asyncio.Queue = asyncio.Queue()
        self._started = [asyncio.Event() for _ in prompts]
        self._errors: list[BaseException | None] = [None] * len(prompts)
        self._timers: list[Any] = [None] * len(prompts)
        self._last: list[RequestOutput | None] = [None] * len(prompts)
        # one id for all prompts: an abort by id reaches every one of them
        self._tasks = [
            asyncio.create_task(self._pump(i, p, params, rid, cache_salt, adapter, stream))
            for i, p in enumerate(prompts)
        ]

    async def _pump(
        self,
        i: int,
        prompt: list[int],
        params: SamplingParams,
        rid: str,
        salt: str | None,
        adapter: str | None,
        stream: bool,
    ) -> None:
        timer, last = self.state.metrics.timer(params), None
        self._timers[i] = timer
        try:
            async for out in self.state.engine.generate(
                prompt, params, rid, cache_salt=salt, adapter=adapter, stream=stream
            ):
                timer.step(out)
                last = self._last[i] = out
                self._started[i].set()
                self._queue.put_nowait((i, out))
        except ValueError as e:  # rejected before it was queued: not a request for the metrics
            self._fail(i, e)
            return
        except BaseException as e:
            timer.end(last, self.n)
            self._fail(i, e)
            if isinstance(e, asyncio.CancelledError):
                raise
            return
        timer.end(last, self.n)

    def _fail(self, i: int, exc: BaseException) -> None:
        self._errors[i] = exc
        self._started[i].set()
        self._queue.put_nowait((i, exc))

    def request_metrics(self) -> dict[str, float | None] | None:
        """vLLM's per-request `metrics` (server.enable_per_request_metrics) of a one-prompt, n=1 request; else None."""
        if not self.state.config.server.enable_per_request_metrics or len(self._timers) != 1 or self.n != 1:
            return None
        last = self._last[0]
        return timing(self._timers[0], last.queue_seconds if last is not None else None)

    async def started(self) -> None:
        """Wait until every prompt was accepted (its first output arrived); raise the first rejection."""
        for event in self._started:
            await event.wait()
        for err in self._errors:
            if err is not None:
                raise err

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each prompt's outputs that carry new tokens or its end. A chunked prefill's steps report the
        request before its first token; streamed, that was an empty first chunk that clients time as
        the first token (vLLM sends nothing until the first token)."""
        remaining, sent = len(self._tasks), [0] * len(self._tasks)
        while remaining:
            i, item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            tokens = sum(len(o.token_ids) for o in item.outputs)
            if not item.finished and tokens == sent[i]:
                continue
            remaining -= item.finished
            sent[i] = tokens
            yield i, item

    async def collect(self) -> list[RequestOutput]:
        finals: list[RequestOutput] = [None] * len(self._tasks)  # type: ignore[list-item]
        async for i, out in self.events():
            finals[i] = out
        return finals

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def run_to_end(request: Request, run: Run) -> list[RequestOutput]:
    try:
        with engine_errors():
            return await until_disconnected(request, run.collect())
    finally:
        await run.close()


async def start_stream(request: Request, run: Run) -> None:
    """Return once every prompt is accepted, so a rejection can still be a 4xx instead of a 200 stream."""
    try:
        with engine_errors():
            await until_disconnected(request, run.started())
    except BaseException:
        await run.close()
        raise


class SSEResponse(StreamingResponse):
    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            # a client that left while a chunk was being sent: close the generator now, not at GC
            await self.body_iterator.aclose()  # type: ignore[union-attr]


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(chunks: AsyncIterator[str], run: Run) -> AsyncIterator[str]:
    """SSE chunks, then `[DONE]`. A failure after the 200 went out can only be told in-band."""
    try:
        async for chunk in chunks:
            yield chunk
    except Exception as e:  # the 200 is gone: tell the client in-band; bugs are logged
        if not isinstance(e, (APIError, EngineDeadError)):
            log.exception("stream failed")
        yield sse_error(e)
    finally:
        await run.close()
    yield SSE_DONE


def sse_error(exc: BaseException) -> str:
    if isinstance(exc, APIError):
        err = exc
    elif isinstance(exc, EngineDeadError):
        err = APIError(503, str(exc))
    else:
        err = APIError(500, f"internal server error: {exc!r}", type="InternalServerError")
    return sse(err.body())
