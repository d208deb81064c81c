"""Plumbing for the processes the engine side starts (the engine core, tensor-parallel workers): the child
dies with its parent, reads its config on stdin, and connects its two ZeroMQ sockets back. Light imports only:
the server imports this before torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import zmq

from rlserve.config.load import configure_logging
from rlserve.config.schema import Config

PARENT_ENV = "RLSERVE_PARENT_PID"


def child_env() -> dict[str, str]:
    """The environment for a child that calls start_child(): it names this process as the one to die with."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def start_tp_worker(args: list[str], payload: bytes) -> subprocess.Popen:
    """`python -m rlserve.engine.tp.worker *args`, dying with this process, its config (`payload`) on stdin."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "rlserve.engine.tp.worker", *args], stdin=subprocess.PIPE, env=child_env()
    )
    assert proc.stdin is not None
    proc.stdin.write(payload)
    proc.stdin.close()
    return proc


def parent_pid() -> int:
    """The process that started this one. Not os.getppid() read at start: a parent that died while this
    process was still importing leaves it reparented already, and then getppid() names the new parent."""
    return int(os.environ.get(PARENT_ENV) or os.getppid())


def die_with_parent(parent: int) -> bool:
    """SIGTERM this process when `parent` dies; False when it is gone already (before prctl took effect)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    return os.getppid() == parent


def start_child() -> Config | None:
    """Die with the parent (None when it is already gone), leave SIGINT to it, read the config it
    writes as JSON on stdin, log as it asks."""
    if not die_with_parent(parent_pid()):
        return None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    config = Config.model_validate_json(sys.stdin.buffer.read())
    configure_logging(config)
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
