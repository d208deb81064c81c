"""Response headers vLLM 0.32 can add: `X-Request-Id` on every response (its --enable-request-id-headers;
the request's own id, else a fresh one), and the ORCA load report `endpoint-load-metrics` on a
non-streamed chat or completions answer whose request asked for one with `endpoint-load-metrics-format`."""

from __future__ import annotations

import json
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ORCA_ROUTES = frozenset(("/v1/chat/completions", "/v1/completions"))


class ResponseHeaders:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        asked = Headers(scope=scope)
        rid = asked.get("x-request-id") or uuid.uuid4().hex
        orca = asked.get("endpoint-load-metrics-format", "").lower()
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/")

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(raw=message["headers"])
                if "x-request-id" not in headers:
                    headers.append("X-Request-Id", rid)
                if orca in ("text", "json") and path in ORCA_ROUTES and message["status"] == 200:
                    if headers.get("content-type", "").startswith("application/json"):
                        headers.append("endpoint-load-metrics", await _load_report(scope, orca))
            await send(message)

        await self.app(scope, receive, send_with_headers)


async def _load_report(scope: Scope, fmt: str) -> str:
    """The two gauges vLLM reports (vllm:kv_cache_usage_perc, vllm:num_requests_waiting), as floats."""
    engine = scope["app"].state.rlserve.engine
    await engine.refresh()
    stats = engine.stats
    named = {"kv_cache_usage_perc": float(stats.kv_cache_usage), "num_requests_waiting": float(stats.num_waiting)}
    if fmt == "json":
        return f"JSON {json.dumps({'named_metrics': named})}"
    return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
