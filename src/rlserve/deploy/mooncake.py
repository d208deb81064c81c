"""The Mooncake master (with its HTTP metadata server) that kv_cache_offload.type = "mooncake" needs, started by
rlserve when no master_address is configured: once per deployment (its replicas get the addresses) or by a
single `rlserve serve`. It runs in its own session, dies with its parent (Linux), and stops with it: SIGTERM,
then SIGKILL. Its warnings and errors go to rlserve's stderr. With kv_cache_offload.disk it gets a directory
under disk.path as its storage root (`--root_fs_dir`): every client writes each block it puts there too, and a
block the master evicts from memory is read back from there; the directory is removed when the master stops."""

from __future__ import annotations

import atexit
import ctypes
import logging
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from rlserve.config.schema import Config, KVMooncakeConfig, KVOffloadDiskConfig
from rlserve.engine.kv.disk_dir import make_private_dir
from rlserve.runtime.ports import free_port

log = logging.getLogger("rlserve.mooncake")
_PR_SET_PDEATHSIG = 1
MASTER_BINARY = "mooncake_master"


def needs_master(config: Config) -> bool:
    o = config.kv_cache_offload
    return o is not None and o.type == "mooncake" and not (o.mooncake and o.mooncake.master_address)


def _accepts(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _child_setup() -> None:
    import os

    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def find_binary() -> str:
    """mooncake_master from the mooncake package's scripts (beside this interpreter) or PATH."""
    beside = Path(sys.executable).with_name(MASTER_BINARY)
    found = str(beside) if beside.exists() else shutil.which(MASTER_BINARY)
    if found is None:
        raise RuntimeError(
            f"kv_cache_offload.type = 'mooncake' needs the {MASTER_BINARY} program: pip install "
            "'rlserve[mooncake]' (or set kv_cache_offload.mooncake.master_address to a running master)"
        )
    return found


class MooncakeMaster:
    """One mooncake_master process with its HTTP metadata server, on free ports of `host`."""

    def __init__(self, host: str = "127.0.0.1", start_timeout_s: float = 30.0, disk: KVOffloadDiskConfig | None = None):
        self.host, self.disk = host, disk
        self.proc: subprocess.Popen | None = None
        self.fs_dir: str | None = None
        binary = find_binary()
        try:
            if disk is not None:
                self.fs_dir = str(make_private_dir(disk.path, "rlserve-mooncake-"))
            for _ in range(3):  # a port taken between choosing and binding: choose again
                self.rpc_port, self.http_port = free_port(host), free_port(host)
                if self._start(binary, start_timeout_s):
                    break
            else:
                raise RuntimeError(
                    f"{MASTER_BINARY} did not start (its errors are above, exit code {self.proc.returncode})"
                )
        except BaseException:
            self.stop()
            raise
        log.info("Mooncake master %s (metadata %s), pid %d", self.master_address, self.metadata_server, self.pid)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else -1

    @property
    def master_address(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://{self.host}:{self.http_port}/metadata"

    def _start(self, binary: str, timeout_s: float) -> bool:
        argv = [
            binary,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_port={free_port(self.host)}",
            "--logtostderr=true",
            "--minloglevel=1",
        ]
        if self.fs_dir is not None:
            # not the store's SSD offload (--enable_offload): with this wheel its master defers evicted blocks
            # "for disk offload" every cycle and no client ever writes one (docs/kv-mooncake.md)
            argv.append(f"--root_fs_dir={self.fs_dir}")
            if self.disk.num_bytes:
                argv.append(f"--quota_bytes={self.disk.num_bytes}")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, preexec_fn=_child_setup)  # noqa: PLW1509 - setsid and prctl only
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            if _accepts(self.host, self.rpc_port) and _accepts(self.host, self.http_port):
                return True
            time.sleep(0.05)
        raise RuntimeError(f"{MASTER_BINARY} did not listen on {self.host} within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.fs_dir is not None:
            shutil.rmtree(self.fs_dir, ignore_errors=True)
            self.fs_dir = None

    def configure(self, config: Config) -> Config:
        """The config with this master's addresses filled in (for the engines and replicas that use it)."""
        o = config.kv_cache_offload
        assert o is not None
        mc = (o.mooncake or KVMooncakeConfig()).model_copy(
            update={"master_address": self.master_address, "metadata_server": self.metadata_server}
        )
        return config.model_copy(update={"kv_cache_offload": o.model_copy(update={"mooncake": mc})})


def start_master_if_needed(config: Config) -> Config:
    """A single `rlserve serve` or a deployment with type = "mooncake" and no master address: start one, stopped
    at exit (the server's and the supervisor's exits run atexit), and return the config pointing at it."""
    if not needs_master(config):
        return config
    master = MooncakeMaster(disk=config.kv_cache_offload.disk)
    atexit.register(master.stop)
    return master.configure(config)
