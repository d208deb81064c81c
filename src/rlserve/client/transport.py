"""HTTP under the client: routing over several base URLs, retries, failover, probes, and the
weight-sync gate that holds new generations while weights change.

All state lives on one event loop; nothing here is thread-safe (SyncInferenceClient runs it on its own thread).
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from rlserve.client.endpoints import Endpoint, Pool, normalize_url
from rlserve.client.errors import (
    BadRequest,
    EndpointUnavailable,
    RLServeError,
    ServerError,
    StreamInterrupted,
    WeightSyncTimeout,
    error_for,
)

# the connection broke or never formed: the endpoint is taken out until a probe brings it back
_CONNECTION_ERRORS = (httpx.NetworkError, httpx.RemoteProtocolError, httpx.ConnectTimeout)
_RETRYABLE = (httpx.TimeoutException, *_CONNECTION_ERRORS)
_WAIT_POLL_S = 0.25  # how often a held call looks again, besides being woken


class Transport:
    def __init__(
        self,
        base_urls: list[str],
        *,
        api_key: str | None,
        admin_api_key: str | None,
        connect_timeout: float,
        read_timeout: float,
        retry_deadline: float,
        backoff_base: float,
        backoff_max: float,
        probe_interval: float,
        weight_sync_timeout: float,
        max_connections: int,
        admin_url: str | None = None,
    ):
        self.pool = Pool(base_urls, probe_interval)
        # a deployment's admin address applies admin calls on every replica behind the base URL(s)
        self.admin = Endpoint(normalize_url(admin_url)) if admin_url else None
        self.retry_deadline, self.weight_sync_timeout = retry_deadline, weight_sync_timeout
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        self._probe_timeout = httpx.Timeout(max(connect_timeout, 5.0), connect=connect_timeout)
        admin_key = admin_api_key or api_key
        self._admin_headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout, pool=None),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
        )
        self._syncs = 0  # weight mutations through this client now running
        self.held = False  # paused through this client: hold generations until resume()
        self._changed = asyncio.Event()

    # ---- one call, routed ----------------------------------------------------------------------

    async def call(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        session_id: str | None = None,
        generation: bool = False,
        allow_mixed_versions: bool = False,
    ) -> tuple[Any, Endpoint]:
        """Send to the session's (or the least busy) endpoint; retry connection errors and 5xx with
        backoff until retry_deadline, on another endpoint when there is one. Generations first wait
        out weight syncs (unless allow_mixed_versions) and ask for no older policy than the endpoint
        already served. Returns (decoded body, endpoint)."""
        gated = generation and not allow_mixed_versions
        headers = {"X-Session-ID": session_id} if session_id is not None else {}
        held_since: list[float] = []  # when this call first waited for a sync; shared by its retries
        attempt, avoid, deadline = 0, None, None
        while True:
            ep = await self._acquire(session_id, gated, avoid, held_since)
            if deadline is None:  # time held for a sync does not count against the retries
                deadline = time.monotonic() + self.retry_deadline
            if ep is None:
                error: RLServeError = EndpointUnavailable(f"no endpoint is up among {self.urls}")
            else:
                try:
                    r = await self._send(ep, method, path, _floored(ep, json, gated), headers)
                except _RETRYABLE as exc:
                    error, avoid = EndpointUnavailable(f"{method} {ep.url}{path} failed: {exc!r}"), ep
                else:
                    data = _decode(r)
                    if r.status_code < 400:
                        if generation:
                            _observe_versions(ep, data)
                        return data, ep
                    if r.status_code == 409 and gated:
                        await self._refresh(ep)
                        if ep.behind:  # it restarted under an older policy: wait for it or move
                            continue
                    error = error_for(r.status_code, data, r.text, ep.url)
                    if r.status_code < 500:
                        raise error
                    avoid = ep
            attempt += 1
            await self._backoff(attempt, deadline, error)

    async def stream(
        self, path: str, *, json: dict[str, Any], session_id: str | None = None, allow_mixed_versions: bool = False
    ) -> AsyncIterator[Any]:
        """POST a streamed generation; yield each SSE `data:` object until `[DONE]`. Until the first
        chunk arrived, failures are retried like call() (nothing reached the caller yet); after it, a
        broken connection, a 5xx error event or a stream ending without `[DONE]` raise StreamInterrupted."""
        gated = not allow_mixed_versions
        headers = {"X-Session-ID": session_id} if session_id is not None else {}
        held_since: list[float] = []
        attempt, avoid, deadline = 0, None, None
        while True:
            ep = await self._acquire(session_id, gated, avoid, held_since)
            if deadline is None:
                deadline = time.monotonic() + self.retry_deadline
            if ep is None:
                error: RLServeError = EndpointUnavailable(f"no endpoint is up among {self.urls}")
            else:
                async with contextlib.aclosing(self._events(ep, path, _floored(ep, json, gated), headers)) as events:
                    try:
                        first = await anext(events)
                    except StopAsyncIteration:
                        return
                    except _RETRYABLE as exc:
                        error, avoid = EndpointUnavailable(f"POST {ep.url}{path} failed: {exc!r}"), ep
                    except (ServerError, StreamInterrupted) as exc:
                        error, avoid = exc, ep
                    except BadRequest as exc:
                        if not (exc.status == 409 and gated):
                            raise
                        await self._refresh(ep)
                        if ep.behind:
                            continue
                        raise
                    else:
                        received = 1
                        yield first
                        try:
                            async for chunk in events:
                                received += 1
                                yield chunk
                        except (*_RETRYABLE, ServerError, StreamInterrupted) as exc:
                            raise StreamInterrupted(
                                f"stream from {ep.url}{path} broke after {received} chunk(s): "
                                f"{exc}; send the request again",
                                received,
                            ) from exc
                        return
            attempt += 1
            await self._backoff(attempt, deadline, error)

    async def _events(
        self, ep: Endpoint, path: str, body: dict[str, Any] | None, headers: dict[str, str]
    ) -> AsyncIterator[Any]:
        """One streamed POST: its SSE data objects; a non-2xx answer or an in-band error event raises
        the typed error; a body that ends without `[DONE]` (a proxy that closed it cleanly) is cut."""
        with self._calling(ep):
            async with self.http.stream("POST", f"{ep.url}{path}", json=body, headers=headers) as r:
                if r.status_code >= 400:
                    await r.aread()
                    raise error_for(r.status_code, _decode(r), r.text, ep.url)
                async for line in r.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    chunk = jsonlib.loads(data)
                    if isinstance(chunk, dict) and "error" in chunk:
                        err = chunk["error"]
                        code = err.get("code") if isinstance(err, dict) else None
                        raise error_for(code if isinstance(code, int) else 500, chunk, data, ep.url)
                    _observe_versions(ep, chunk)
                    yield chunk
            raise StreamInterrupted(f"stream from {ep.url}{path} ended without [DONE]", 0)

    async def _acquire(
        self, session_id: str | None, gated: bool, avoid: Endpoint | None, held_since: list[float]
    ) -> Endpoint | None:
        """The endpoint to send to, once no weight sync holds it; None when no endpoint is up."""
        while True:
            self._probe_due()
            ep = self.pool.pick(session_id, gated, avoid)
            if ep is not None and ep.probe is not None:  # stale state: refresh it before trusting it
                await asyncio.shield(ep.probe)
                continue
            if ep is None and not any(e.up for e in self.pool.endpoints):
                return None
            if ep is not None and not (gated and (self._syncs or self.held or ep.paused)):
                return ep
            now = time.monotonic()
            if not held_since:
                held_since.append(now)
            remaining = held_since[0] + self.weight_sync_timeout - now
            if remaining <= 0:
                raise WeightSyncTimeout(
                    f"waited {self.weight_sync_timeout:.1f}s for a weight sync to end: {self.sync_state()}"
                )
            await self._wait_change(min(remaining, _WAIT_POLL_S))

    def sync_state(self) -> str:
        parts = [f"{self._syncs} update(s) through this client"] if self._syncs else []
        if self.held:
            parts.append("paused through this client (call resume())")
        for e in self.pool.endpoints:
            if e.paused:
                parts.append(f"{e.url} is paused")
            if e.behind:
                parts.append(
                    f"{e.url} serves policy_version {e.policy_version} < {e.floor} it served before "
                    "(restarted? push the weights again through update_weights)"
                )
        return "; ".join(parts) or "nothing in progress"

    # ---- admin: every endpoint -----------------------------------------------------------------

    async def broadcast(
        self,
        method: str,
        path: str,
        *,
        json: dict[str, Any] | None = None,
        params: dict[str, str] | None = None,
        admin: bool = True,
    ) -> dict[str, Any]:
        """Send to every endpoint (down ones too), or to the admin address when there is one, each with
        its own retries; maps URL to the decoded answer or the exception it ended with."""
        targets = [self.admin] if admin and self.admin is not None else self.pool.endpoints
        results = await asyncio.gather(
            *(self._admin_call(ep, method, path, json, params) for ep in targets), return_exceptions=True
        )
        return {ep.url: r for ep, r in zip(targets, results, strict=True)}

    def governed(self, url: str) -> list[Endpoint]:
        """The endpoints an admin answer from `url` speaks for."""
        if self.admin is not None and url == self.admin.url:
            return self.pool.endpoints
        return [self.endpoint(url)]

    async def _admin_call(
        self, ep: Endpoint, method: str, path: str, json: dict[str, Any] | None, params: dict[str, str] | None
    ) -> Any:
        deadline, attempt = time.monotonic() + self.retry_deadline, 0
        while True:
            try:
                r = await self._send(ep, method, path, json, self._admin_headers, params)
            except _RETRYABLE as exc:
                error: RLServeError = EndpointUnavailable(f"{method} {ep.url}{path} failed: {exc!r}")
            else:
                data = _decode(r)
                if r.status_code < 400:
                    return data
                error = error_for(r.status_code, data, r.text, ep.url)
                if r.status_code < 500:
                    raise error
            attempt += 1
            await self._backoff(attempt, deadline, error)

    @contextlib.asynccontextmanager
    async def syncing(self) -> AsyncIterator[None]:
        """Hold new gated generations while the body runs."""
        self._syncs += 1
        try:
            yield
        finally:
            self._syncs -= 1
            self.notify()

    def set_held(self, held: bool) -> None:
        self.held = held
        self.notify()

    # ---- probes --------------------------------------------------------------------------------

    async def probe_all(self) -> None:
        for ep in self.pool.endpoints:
            if ep.probe is None:
                ep.probe = asyncio.ensure_future(self._probe(ep))
        await asyncio.gather(*(asyncio.shield(ep.probe) for ep in self.pool.endpoints if ep.probe is not None))

    async def _refresh(self, ep: Endpoint) -> None:
        if ep.probe is None:
            ep.probe = asyncio.ensure_future(self._probe(ep))
        await asyncio.shield(ep.probe)

    def _probe_due(self) -> None:
        for ep in self.pool.due(time.monotonic()):
            ep.probe = asyncio.ensure_future(self._probe(ep))

    async def _probe(self, ep: Endpoint) -> None:
        """/health says up or down; the JSON metrics say paused and which policy it serves."""
        try:
            r = await self.http.get(f"{ep.url}/health", timeout=self._probe_timeout)
            if r.status_code != 200:
                ep.went_down()
                return
            m = await self.http.get(f"{ep.url}/metrics", params={"format": "json"}, timeout=self._probe_timeout)
            if m.status_code == 200 and "json" not in m.headers.get("content-type", ""):
                # vllm-router drops the query: ask a worker behind it for the same figures
                m = await self.http.get(f"{ep.url}/get_server_info", timeout=self._probe_timeout)
            state = m.json() if m.status_code == 200 else {}
            state = state if isinstance(state, dict) else {}
            state.setdefault("current_policy_version", state.get("policy_version", ep.policy_version))
            ep.probed(int(state.get("current_policy_version", ep.policy_version)), bool(state.get("is_paused", False)))
        except (httpx.TransportError, ValueError):
            ep.went_down()
        finally:
            ep.checked_at, ep.probe = time.monotonic(), None
            self.notify()

    # ---- plumbing ------------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [e.url for e in self.pool.endpoints]

    def endpoint(self, url: str) -> Endpoint:
        return next(e for e in self.pool.endpoints if e.url == url)

    async def _send(
        self,
        ep: Endpoint,
        method: str,
        path: str,
        json: dict[str, Any] | None,
        headers: dict[str, str],
        params: dict[str, str] | None = None,
    ) -> httpx.Response:
        with self._calling(ep):
            return await self.http.request(method, f"{ep.url}{path}", json=json, headers=headers, params=params)

    @contextlib.contextmanager
    def _calling(self, ep: Endpoint) -> Iterator[None]:
        """Count the call as open on ep; a connection error marks ep down and wakes the waiting calls."""
        ep.in_flight += 1
        try:
            yield
        except _CONNECTION_ERRORS:
            if ep.up:
                ep.went_down()
                self.notify()
            raise
        finally:
            ep.in_flight -= 1

    async def _backoff(self, attempt: int, deadline: float, error: Exception) -> None:
        """Exponential backoff with full jitter; give up with `error` when the deadline would pass."""
        delay = random.uniform(0, min(self.backoff_max, self.backoff_base * 2**attempt))
        if time.monotonic() + delay > deadline:
            raise error
        await asyncio.sleep(delay)

    def notify(self) -> None:
        """Wake every held call to look again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, timeout: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    async def aclose(self) -> None:
        probes = [ep.probe for ep in self.pool.endpoints if ep.probe is not None]
        for task in probes:
            task.cancel()
        await asyncio.gather(*probes, return_exceptions=True)
        await self.http.aclose()


def _decode(r: httpx.Response) -> Any:
    try:
        return r.json()
    except ValueError:
        return r.text


def _floored(ep: Endpoint, body: dict[str, Any] | None, gated: bool) -> dict[str, Any] | None:
    """Ask for no older policy than this endpoint already served (it may have restarted on older weights)."""
    if gated and ep.floor > 0 and body is not None:
        return {**body, "min_policy_version": max(ep.floor, body.get("min_policy_version") or 0)}
    return body


def _observe_versions(ep: Endpoint, data: Any) -> None:
    if isinstance(data, dict):
        versions = [c.get("policy_version") for c in data.get("choices") or [] if isinstance(c, dict)]
        versions = [v for v in versions if isinstance(v, int)]
        if versions:
            ep.observed(max(versions))
