"""`SyncInferenceClient`: the async client run on a private event-loop thread, for plain Python code.

Every method blocks until the async one finishes; it is safe to call from several threads at once
(calls then overlap on the loop exactly like concurrent async calls).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from rlserve.client.client import Completions, InferenceClient
from rlserve.client.sample import Sample

T = TypeVar("T")


class SyncInferenceClient:
    """Takes InferenceClient's arguments; same methods, blocking."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="rlserve-client", daemon=True)
        self._thread.start()
        self.aio = InferenceClient(*args, **kwargs)  # the async client underneath, for its attributes
        self.completions = SyncCompletions(self, self.aio.completions)
        self.chat = SyncChat(self)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._loop.is_closed():
            coro.close()
            raise RuntimeError("this SyncInferenceClient is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _iterate(self, chunks: AsyncIterator[T]) -> Iterator[T]:
        """A stream of the loop thread's async iterator, one item per blocking step."""

        async def step() -> T:
            return await anext(chunks)

        try:
            while True:
                try:
                    yield self._run(step())
                except StopAsyncIteration:
                    return
        finally:
            if not self._loop.is_closed():
                self._run(chunks.aclose())  # type: ignore[attr-defined]

    @property
    def base_urls(self) -> list[str]:
        return self.aio.base_urls

    def generate(self, *args: Any, **kwargs: Any) -> Sample:
        return self._run(self.aio.generate(*args, **kwargs))

    def generate_group(self, *args: Any, **kwargs: Any) -> list[Sample]:
        return self._run(self.aio.generate_group(*args, **kwargs))

    def tokenize(self, *args: Any, **kwargs: Any) -> list[int]:
        return self._run(self.aio.tokenize(*args, **kwargs))

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> list[int]:
        return self._run(self.aio.apply_chat_template(*args, **kwargs))

    def detokenize(self, *args: Any, **kwargs: Any) -> str:
        return self._run(self.aio.detokenize(*args, **kwargs))

    def update_weights(self, *args: Any, **kwargs: Any) -> dict[str, int]:
        return self._run(self.aio.update_weights(*args, **kwargs))

    def load_adapter(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.aio.load_adapter(*args, **kwargs))

    def unload_adapter(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.aio.unload_adapter(*args, **kwargs))

    def pause(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return self._run(self.aio.pause(*args, **kwargs))

    def resume(self) -> dict[str, Any]:
        return self._run(self.aio.resume())

    def health(self) -> dict[str, bool]:
        return self._run(self.aio.health())

    def metrics(self) -> dict[str, dict[str, Any]]:
        return self._run(self.aio.metrics())

    def models(self) -> dict[str, Any]:
        return self._run(self.aio.models())

    def close(self) -> None:
        if self._loop.is_closed():
            return
        self._run(self.aio.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> SyncInferenceClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class SyncCompletions:
    def __init__(self, owner: SyncInferenceClient, target: Completions):
        self._owner, self._target = owner, target

    def create(self, **kwargs: Any) -> dict[str, Any] | Iterator[dict[str, Any]]:
        result = self._owner._run(self._target.create(**kwargs))
        return self._owner._iterate(result) if isinstance(result, AsyncIterator) else result


class SyncChat:
    """`client.chat(messages, ...)` -> Sample; `client.chat.completions.create(...)` -> dict."""

    def __init__(self, owner: SyncInferenceClient):
        self._owner = owner
        self.completions = SyncCompletions(owner, owner.aio.chat.completions)

    def __call__(self, messages: list[dict[str, Any]], **kwargs: Any) -> Sample:
        return self._owner._run(self._owner.aio.chat(messages, **kwargs))
