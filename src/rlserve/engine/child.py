"""Plumbing for the processes the engine side starts (the engine core, tensor-parallel workers): the child
dies with its parent, reads its config on stdin, and connects its two ZeroMQ sockets back; when it is forked
instead of spawned, its parent holds it as a ForkedProcess. Light imports only: the server imports this before
torch."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable

import setproctitle
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


def as_forked_child(parent: int, title: str) -> bool:
    """In a child forked from `parent` (no exec): what a spawned child starts with and the parent's state would
    leave out. Its own name in ps (`title`), default SIGTERM, SIGINT left to the parent, signals the parent held
    across the fork let through, /dev/null for stdin, death with `parent`. False when `parent` is gone already."""
    os.environ[PARENT_ENV] = str(parent)  # not the parent's own parent, which the environment may name
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    setproctitle.setproctitle(title)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return die_with_parent(parent)


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


def can_fork() -> bool:
    """Linux, no other Python thread (one could hold a lock the child would wait on forever), CUDA not
    initialised (a CUDA context does not survive a fork)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def fork_child(run: Callable[[], int]) -> ForkedProcess:
    """Fork; the child runs `run` and exits with its code, never back into the parent's code (no teardown of what
    the parent set up). Ask can_fork first."""
    sys.stdout.flush()  # or the child would write what this process printed again
    sys.stderr.flush()
    with warnings.catch_warnings():  # Python 3.12+ warns of any thread; numpy's OpenBLAS pool is fork-aware
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid:
        return ForkedProcess(pid)
    code = 1
    try:
        code = run()
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ForkedProcess:
    """A forked child (an engine core, a tensor-parallel worker) with the part of subprocess.Popen's face that
    their parents use."""

    def __init__(self, pid: int):
        self.pid, self.returncode = pid, None
        self._reaping = threading.Lock()  # the client's watcher and stop() may ask at once; one reaps

    def poll(self) -> int | None:
        with self._reaping:
            if self.returncode is None:
                try:
                    pid, status = os.waitpid(self.pid, os.WNOHANG)
                except ChildProcessError:  # reaped without us (SIGCHLD ignored): its code is lost, as Popen says
                    pid, status = self.pid, 0
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"process {self.pid}", timeout)
            time.sleep(0.01)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
