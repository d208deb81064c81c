"""A replica of a deployment takes admin calls only from its deployment's admin address: the router would
forward a user's /update_weights to one replica and the replicas would drift apart.

The supervisor sets RLSERVE_DEPLOYMENT_KEY (and the admin URL to name in refusals) in the replica's
environment; without it the server is standalone and this module adds nothing.
"""

from __future__ import annotations

import hmac
import os

from fastapi import APIRouter, FastAPI, Request
from starlette.types import ASGIApp, Receive, Scope, Send

from rlserve.server.auth import ADMIN_PATHS
from rlserve.server.errors import APIError, bad_request
from rlserve.server.fleet import save_weights
from rlserve.server.state import ServerState, json_body

KEY_ENV, ADMIN_URL_ENV = "RLSERVE_DEPLOYMENT_KEY", "RLSERVE_DEPLOYMENT_ADMIN_URL"
KEY_HEADER = b"x-rlserve-deployment-key"
SYNC_PATH = "/deployment/sync_version"
DEPLOYMENT_PATHS = frozenset({SYNC_PATH, save_weights.SAVE_PATH})  # the supervisor's own calls to its replicas

router = APIRouter()


def install(app: FastAPI) -> None:
    key = os.environ.get(KEY_ENV)
    if key:
        app.include_router(router)
        app.include_router(save_weights.router)
        app.add_middleware(DeploymentGuard, key=key, admin_url=os.environ.get(ADMIN_URL_ENV, "the admin address"))


class DeploymentGuard:
    def __init__(self, app: ASGIApp, key: str, admin_url: str):
        self.app, self.key, self.admin_url = app, key.encode(), admin_url

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = scope["path"].rstrip("/") or "/"
            if (path in ADMIN_PATHS or path in DEPLOYMENT_PATHS) and not self._from_deployment(scope):
                error = APIError(
                    403,
                    f"this server is a replica of a deployment: send {path} to the deployment's "
                    f"admin address {self.admin_url}, which applies it on every replica",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _from_deployment(self, scope: Scope) -> bool:
        value = dict(scope.get("headers", ())).get(KEY_HEADER, b"")
        return hmac.compare_digest(value, self.key)


@router.post(SYNC_PATH)
async def sync_version(request: Request) -> dict:
    """The supervisor's last step when a restarted replica has replayed the deployment's weights: take
    the deployment's version numbers, so every replica labels the same weights alike."""
    body = await json_body(request)
    try:
        policy_version, label = int(body["policy_version"]), str(body["weight_version"])
    except (KeyError, TypeError, ValueError):
        raise bad_request("policy_version (int) and weight_version (str) are required") from None
    state: ServerState = request.app.state.rlserve
    await state.engine.set_versions(policy_version, label)
    return {"policy_version": policy_version, "weight_version": label}
