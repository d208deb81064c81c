"""Starting an engine core process (runtime/core.py) and stopping it.

The server (rlserve.cli) forks its engine core once it has imported torch and the engine: the child
starts with everything imported, and the two processes pay for those imports once (~4.5 s of CPU
less, benchmarks/server_start.py), as vLLM forks its engine core. Where forking is unsafe, or with
engine.core_start = "spawn", the core is a fresh `python -m rlserve.runtime.core`, started before the
server imports torch so that the two import side by side. This module imports light things only; the
forking path imports the core.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import types
from collections.abc import Iterator

import zmq

from rlserve.config.schema import Config
from rlserve.engine.child import ForkedProcess, can_fork, child_env, fork_child


class EngineProcess:
    """The engine core process loading `config`'s model, and this side's two sockets to it: ipc:// in a
    private directory, never a network port. Reading its Ready message is the EngineClient's part."""

    def __init__(self, config: Config, fork: bool = False):
        """`fork`: fork this process, which must not have run a torch op (OpenMP's thread pool does not survive
        a fork); it spawns instead where forking is unsafe (can_fork). Interrupted (the server's SIGTERM while
        it starts), it stops what it started before it raises."""
        self.dir = tempfile.mkdtemp(prefix="rlserve-engine-")  # 0700: only this user reaches the sockets
        in_addr, out_addr = f"ipc://{self.dir}/in", f"ipc://{self.dir}/out"
        self.proc: subprocess.Popen | ForkedProcess | None = None
        self.ctx: zmq.Context | None = None
        self.to_engine = self.from_engine = None
        self.stopped = False
        try:
            if fork:  # before ZeroMQ starts its I/O thread; the child's connects wait for the binds
                from rlserve.runtime import core  # torch and the engine, imported once for both processes

                with signals_held():  # a SIGTERM now is handled once self.proc names the child, which stop() ends
                    self.proc = fork_core(core, config, in_addr, out_addr)
            self.ctx = zmq.Context()
            self.to_engine = self._socket(zmq.PUSH, in_addr)
            self.from_engine = self._socket(zmq.PULL, out_addr)
            if self.proc is None:
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", "rlserve.runtime.core", in_addr, out_addr],
                    stdin=subprocess.PIPE,
                    env=child_env(),
                )
                self.proc.stdin.write(config.model_dump_json().encode())
                self.proc.stdin.close()
        except BaseException:
            self.stop()
            raise

    def _socket(self, kind: int, addr: str) -> zmq.Socket:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.bind(addr)
        return sock

    def stop(self, goodbye: bytes | None = None) -> None:
        """Send `goodbye` (the engine's Shutdown message), or SIGTERM without one (an engine still loading
        reads no messages), and wait for the process to exit; terminate it, then kill it, when it does not.
        Nothing is left behind: the process, its sockets, their directory."""
        if self.stopped:
            return
        if self.proc is not None and self.proc.poll() is None:
            try:
                if goodbye is None or self.to_engine is None:
                    self.proc.terminate()
                else:
                    self.to_engine.send(goodbye, zmq.NOBLOCK)
                self.proc.wait(timeout=10)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                self.proc.terminate()
                try:
                    self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        if self.ctx is not None:
            # every socket the context made, not only those named here: the server's SIGTERM unwinds as SystemExit
            # wherever it lands (early_stop), also between making a socket and naming it, and a socket left open
            # would keep term() waiting forever
            self.ctx.destroy(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.stopped = True


HELD_SIGNALS = {signal.SIGTERM, signal.SIGINT}


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGTERM and SIGINT wait (blocked, pending) until the block ends: no handler runs between a fork and
    the parent's record of its child. The forked child unblocks them itself (core.main_forked)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, HELD_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


def fork_core(core: types.ModuleType, config: Config, in_addr: str, out_addr: str) -> ForkedProcess | None:
    """Fork; the child runs the imported engine `core` (core.main_forked) and never returns. None where
    forking is unsafe (can_fork, asked after the imports, which could have initialised CUDA)."""
    if not can_fork():
        return None
    parent = os.getpid()
    return fork_child(lambda: core.main_forked(config, in_addr, out_addr, parent))
