"""The wire between the API server and an engine core process: msgspec messages over ZeroMQ.

Every message has a fixed schema and decodes into plain data or our own dataclasses (never
pickle). Outputs, sampling params and stats cross as their dataclass fields, so a field added
to `RequestOutput`, `SamplingParams` or `EngineStats` crosses without edits here.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import msgspec
import numpy as np
import zmq

from rlserve.config.schema import Config

from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.runtime.spawn import PARENT_ENV
from rlserve.engine.weights import WeightUpdateError
from rlserve.model.lora import AdapterError

# ---- server -> engine -----------------------------------------------------------------------


class Add(msgspec.Struct, tag=True, array_like=True):
    key: int  # the client's stream handle (request ids may repeat)
    request_id: str
    prompt: list[int] | str
    params: SamplingParams
    cache_salt: str | None
    adapter: str | None
    stream: bool  # every step's output; else only the first and the last


class Abort(msgspec.Struct, tag=True, array_like=True):
    key: int  # the client left: free the request


class Call(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    op: str  # one of core.OPS; unknown names are answered with an error
    args: list[Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToEngine = Add | Abort | Call | Shutdown

# ---- engine -> server -----------------------------------------------------------------------


class State(msgspec.Struct):
    """What the server reads without asking: refreshed with every reply."""

    policy_version: int
    weight_version: str
    adapters: dict[str, str]  # name -> path
    paused: bool
    stats: dict[str, Any]  # EngineStats fields, whatever they are


class Outputs(msgspec.Struct, tag=True, array_like=True):
    items: list[tuple[int, RequestOutput]]  # (key, cumulative output) of one step
    state: State  # as after the step: back-pressure reads the waiting queue without asking


class Rejected(msgspec.Struct, tag=True, array_like=True):
    key: int
    message: str  # make_request's ValueError: a 400 naming the field


class Reply(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    value: Any
    error_kind: str | None
    error: str | None
    state: State


class Ready(msgspec.Struct, tag=True, array_like=True):
    model_dir: str
    max_model_len: int
    vocab_size: int
    shape: dict[str, Any]  # ModelShape fields
    state: State


class Failed(msgspec.Struct, tag=True, array_like=True):
    message: str  # the engine could not start, or its step loop died


ToServer = Outputs | Rejected | Reply | Ready | Failed

# the exception types that cross the boundary by name; anything else arrives as RuntimeError
ERRORS: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (ValueError, WeightUpdateError, AdapterError, FileNotFoundError, PermissionError, KeyError,
                RuntimeError, TimeoutError)
}


def error_kind(exc: BaseException) -> str:
    for cls in type(exc).__mro__:
        if cls.__name__ in ERRORS:
            return cls.__name__
    return "RuntimeError"


def rebuild_error(kind: str | None, message: str | None) -> Exception:
    return ERRORS.get(kind or "", RuntimeError)(message or "")


def _encode_array(obj: Any) -> Any:
    # numpy fields (router replay's expert ids) cross as dtype, shape and raw bytes
    if isinstance(obj, np.ndarray):
        return {"dtype": obj.dtype.str, "shape": list(obj.shape), "data": np.ascontiguousarray(obj).tobytes()}
    raise NotImplementedError(f"cannot send {type(obj).__name__} to or from the engine")


def _decode_array(kind: type, obj: Any) -> Any:
    if kind is np.ndarray:
        dtype = np.dtype(obj["dtype"])
        if dtype.kind not in "iuf":  # numbers only: never object arrays
            raise ValueError(f"array dtype {dtype} cannot cross the engine boundary")
        return np.frombuffer(obj["data"], dtype=dtype).reshape(obj["shape"]).copy()
    raise NotImplementedError(f"cannot decode {kind.__name__}")


encode = msgspec.msgpack.Encoder(enc_hook=_encode_array).encode
to_engine = msgspec.msgpack.Decoder(ToEngine, dec_hook=_decode_array)
to_server = msgspec.msgpack.Decoder(ToServer, dec_hook=_decode_array)


# ---- processes the engine side starts (the engine core, tensor-parallel workers) -------------


def parent_pid() -> int:
    """The process that started this one. Not os.getppid() read at start: a parent that died while this
    process was still importing leaves it reparented already, and then getppid() names the new parent."""
    return int(os.environ.get(PARENT_ENV) or os.getppid())


def start_child() -> Config | None:
    """Die with the parent (None when it is already gone), leave SIGINT to it, read the config it
    writes as JSON on stdin, log as it asks."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid():  # the parent died before prctl took effect
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = Config.model_validate_json(sys.stdin.buffer.read())
    logging.basicConfig(level=config.server.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return config


def connect_pair(ctx: zmq.Context, in_addr: str, out_addr: str, linger_ms: int) -> tuple[zmq.Socket, zmq.Socket]:
    """(inbox, outbox) to the parent's bound sockets, without high-water marks."""
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (inbox, outbox):
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    return inbox, outbox
