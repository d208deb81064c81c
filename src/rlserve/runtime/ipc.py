"""The wire between the API server and an engine core process: msgspec messages over ZeroMQ.

Every message has a fixed schema and decodes into plain data or our own dataclasses (never
pickle). Outputs, sampling params and stats cross as their dataclass fields, so a field added
to `RequestOutput`, `SamplingParams` or `EngineStats` crosses without edits here.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams

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


class Delta(msgspec.Struct, array_like=True):
    """One request's output as what is new since its stream's last message (runtime/output_delta.py)."""

    key: int
    output: RequestOutput  # each sample's lists and text from its start on; prompt fields empty if kept
    starts: list[tuple[int, int]]  # per sample: (token offset, text offset) its tail continues from
    prompt_kept: bool  # the prompt's fields were sent before and left out


class Outputs(msgspec.Struct, tag=True, array_like=True):
    items: list[Delta]  # every request the step touched
    state: State  # as after the step: back-pressure reads the waiting queue without asking


class Rejected(msgspec.Struct, tag=True, array_like=True):
    key: int
    message: str  # make_request's ValueError: a 400 naming the field
    unavailable: bool = False  # the engine cannot run requests now (a 503), not a bad request


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
