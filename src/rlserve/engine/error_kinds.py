"""The exception types that cross a process boundary (engine core, tensor-parallel workers) by name, so the
caller raises the same type the far side raised; anything else arrives as RuntimeError."""

from __future__ import annotations

from rlserve.engine.weights import WeightUpdateError
from rlserve.model.lora import AdapterError

# the exception types that cross the boundary by name; anything else arrives as RuntimeError
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        ValueError,
        WeightUpdateError,
        AdapterError,
        FileNotFoundError,
        PermissionError,
        KeyError,
        RuntimeError,
        TimeoutError,
    )
}


def error_kind(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS:
            return cls.__name__
    return "RuntimeError"


def rebuild_error(kind: str | None, message: str | None) -> Exception:
    return ERRORS.get(kind or "", RuntimeError)(message or "")
