"""OpenAI-style error bodies: every client mistake is a 4xx JSON `{"error": {...}}`, never a 5xx.

Validation failures are 400 (vLLM parity), not FastAPI's 422: SDKs and routers treat 400 as
"fix the request", and retry 5xx.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    503: "ServiceUnavailableError",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers or {}
        self.type = type or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.status,
            }
        }

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers={**self.headers, **(headers or {})})


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def from_value_error(exc: ValueError, fields: set[str] | frozenset[str] = frozenset()) -> APIError:
    """Engine and SamplingParams errors start with the field name; surface it as `param`."""
    message = str(exc)
    first = message.split(" ", 1)[0].split("=", 1)[0]
    return bad_request(message, first if first in fields else None)


def validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    parts, params = [], []
    for err in exc.errors():
        # drop the "body" prefix and pydantic's union tags ("list[int]", "function-after[...]")
        loc = [str(p) for p in err.get("loc", ()) if p != "body" and not _is_union_tag(p)]
        where = ".".join(loc)
        if err.get("type") == "json_invalid":
            text = f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}"
        elif not where:
            text = f"request body: {err.get('msg')}"
        else:
            text = f"{where}: {str(err.get('msg')).removeprefix('Value error, ')}"
        if text not in parts:
            parts.append(text)
            params.append(where or None)
    return "; ".join(parts[:3]) or "invalid request", params[0] if params else None


def _is_union_tag(part: object) -> bool:
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "list", "dict", "none"))


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc)
        return bad_request(message, param).response()

    @app.exception_handler(ValidationError)
    async def _inner_validation(request: Request, exc: ValidationError) -> JSONResponse:
        # a body converted inside a route (Responses -> chat) is still the client's body
        message, param = validation_message(RequestValidationError(exc.errors()))
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        return APIError(exc.status_code, message).response()

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s %s", request.method, request.url.path)
        return APIError(500, f"internal server error: {exc!r}", type="InternalServerError").response()
