"""What a caller can catch: one base class, a few kinds it can act on."""

from __future__ import annotations

from typing import Any

# phrases the server and its peers use for an over-long prompt (docs/protocols.md §2.0, §1 verifiers)
_CONTEXT_PHRASES = ("maximum context length", "context length", "maximum model length", "prompt_too_long")


class RLServeError(Exception):
    """Base of every error the client raises on purpose."""


class BadRequest(RLServeError):
    """A 4xx: the request is wrong and retrying it cannot help. `message` is the server's."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"{status} from {url}: {message}" if url else f"{status}: {message}")
        self.status, self.message, self.url = status, message, url


class ContextLengthExceeded(BadRequest):
    """The prompt does not fit the model's context (pass on_overflow="truncate_sample" to get an empty sample)."""


class RetryableError(RLServeError):
    """The request itself was fine: the same call may succeed if sent again (after the client's own retries)."""


class ServerError(RetryableError):
    """5xx answers until the retry deadline ran out."""

    def __init__(self, status: int, message: str, url: str = ""):
        super().__init__(f"{status} from {url}: {message}")
        self.status, self.message, self.url = status, message, url


class EndpointUnavailable(RetryableError):
    """No endpoint could be reached before the retry deadline."""


class StreamInterrupted(RetryableError):
    """A stream broke after it had delivered `received` chunks: its server (or the replica behind a router)
    died, or it sent an in-band 5xx error. Never resumed on its own: the caller holds part of one sample,
    and a sample is only whole from one run, so send the request again from scratch."""

    def __init__(self, message: str, received: int):
        super().__init__(message)
        self.received = received


class WeightSyncTimeout(RLServeError):
    """A call waited longer than weight_sync_timeout for a weight update or pause to end."""


class AdminError(RLServeError):
    """An admin call failed on some endpoints. `results` maps every base URL to its answer or its error."""

    def __init__(self, message: str, results: dict[str, Any]):
        super().__init__(message)
        self.results = results


def error_for(status: int, body: Any, text: str, url: str) -> RLServeError:
    """The typed error for a non-2xx answer, with the server's message (OpenAI error shape when present)."""
    message = text
    if isinstance(body, dict):
        err = body.get("error")
        message = err.get("message", text) if isinstance(err, dict) else str(err or body.get("detail") or text)
    if status >= 500:
        return ServerError(status, message, url)
    if status == 400 and any(p in message.lower() for p in _CONTEXT_PHRASES):
        return ContextLengthExceeded(status, message, url)
    return BadRequest(status, message, url)
