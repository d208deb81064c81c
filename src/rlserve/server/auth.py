"""Who may call which route, in one place: the admin routes (admin_api_key; a deployment owns them), the
public ones (no key: health probes, Prometheus, the API docs), and every other route (api_key). `Gate` applies
the rules to each request. A deployment's replicas add one more (server/fleet/deployment_guard.py: admin routes
only from the deployment's admin address)."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.server.errors import APIError

if TYPE_CHECKING:
    from rlserve.server.state import ServerState

# routes that change what every user is served: admin_api_key guards them, deployments own them
ADMIN_PATHS = frozenset(
    {
        "/update_weights",
        "/init_broadcaster",
        "/pause",
        "/resume",
        "/abort_requests",
        "/reset_prefix_cache",
        "/load_lora_adapter",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/load_adapter",
        "/upload_adapter",
        "/update_weights_from_disk",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/abort_request",
        "/update_weight_version",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/finish_weight_update",  # vLLM's (server/rl/weights.py)
        "/shutdown_weight_transfer_engine",
        "/weight_checker",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        "/collective_rpc",
    }
)

# no key needed: router health probes and Prometheus scrapers carry none (§2.13)
PUBLIC_PATHS = frozenset(
    {
        "/health",
        "/liveness",
        "/ping",
        "/version",
        "/load",
        "/get_load",
        "/metrics",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
        "/openapi.json",
    }
)


class Gate:
    """Drops a trailing slash before routing (TRL legacy uses them; no redirects) and checks keys:
    admin routes need admin_api_key when it is set; every other non-public route needs api_key
    (the admin key is accepted there too). While shutting down, new work gets 503."""

    def __init__(
        self, app: ASGIApp, api_key: str | None, admin_api_key: str | None = None, state: ServerState | None = None
    ):
        self.app, self.api_key, self.admin_api_key, self.state = app, api_key, admin_api_key, state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = route_path(scope)
            if len(path) > 1 and path.endswith("/"):
                path = path.rstrip("/") or "/"
                scope = {**scope, "path": path, "raw_path": scope.get("raw_path", b"").rstrip(b"/")}
            if path in ADMIN_PATHS and self.admin_api_key:
                allowed = [self.admin_api_key]
            elif path in PUBLIC_PATHS:
                allowed = []
            else:
                allowed = [k for k in (self.api_key, self.admin_api_key if self.api_key else None) if k]
            if allowed and not self._authorized(scope, allowed):
                await JSONResponse({"error": "Unauthorized"}, status_code=401)(scope, receive, send)
                return
            # admin routes stay open so a trainer can still resume or abort what is held
            if self.state is not None and self.state.draining and path not in ADMIN_PATHS | {"/metrics"}:
                error = APIError(503, "the server is shutting down: send new requests to another replica")
                await JSONResponse(error.body(), status_code=503, headers={"Retry-After": "1"})(scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _authorized(scope: Scope, keys: list[str]) -> bool:
        for key, value in scope.get("headers", ()):
            if key == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                token = token.strip().encode()
                matches = [hmac.compare_digest(token, k.encode()) for k in keys]  # no early exit: constant time
                return scheme.lower() == "bearer" and any(matches)
        return False


def route_path(scope: Scope) -> str:
    """The path the routes see: without the --root-path prefix when the request carries it (as Starlette
    routes), so the key checks judge the same route that runs."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and path.startswith(root) and (len(path) == len(root) or path[len(root)] == "/"):
        return path[len(root) :] or "/"
    return path
