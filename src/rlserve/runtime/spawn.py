"""Starting an engine core process (runtime/core.py) and stopping it, with light imports only.

The API server starts its engine before it imports torch and the server stack itself, so that the
two processes import side by side: on 2 cores a server is up seconds sooner (rlserve.cli).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile

import zmq

from rlserve.config.schema import Config
from rlserve.engine.child import child_env


class EngineProcess:
    """The engine core process loading `config`'s model, and this side's two sockets to it: ipc:// in a
    private directory, never a network port. Reading its Ready message is the EngineClient's part."""

    def __init__(self, config: Config):
        self.dir = tempfile.mkdtemp(prefix="rlserve-engine-")  # 0700: only this user reaches the sockets
        in_addr, out_addr = f"ipc://{self.dir}/in", f"ipc://{self.dir}/out"
        self.ctx = zmq.Context()
        self.to_engine = self._socket(zmq.PUSH, in_addr)
        self.from_engine = self._socket(zmq.PULL, out_addr)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rlserve.runtime.core", in_addr, out_addr], stdin=subprocess.PIPE, env=child_env()
        )
        try:
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

    @property
    def stopped(self) -> bool:
        return self.ctx.closed

    def stop(self, goodbye: bytes | None = None) -> None:
        """Send `goodbye` (the engine's Shutdown message), or SIGTERM without one (an engine still loading
        reads no messages), and wait for the process to exit; terminate it, then kill it, when it does not.
        Nothing is left behind: the process, its sockets, their directory."""
        if self.ctx.closed:
            return
        if self.proc.poll() is None:
            try:
                if goodbye is None:
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
        self.from_engine.close(linger=0)
        self.to_engine.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.dir, ignore_errors=True)
