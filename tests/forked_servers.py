"""Test servers forked from one process that imported the server stack once (multiprocessing's forkserver, with
torch, transformers, the engine and the server preloaded), each running `rlserve serve` as the command line
would. A fresh `python -m rlserve.cli serve` spends ~6 s of CPU importing them, and the suite starts ~170
servers on two cores; tests of how a process starts exec one afresh instead (conftest.start_server), and so
does a server whose environment sets what the preloaded process read as it loaded (READ_AT_IMPORT). A config's
`env_vars` reach a forked server after those loads: give such settings in the environment."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from rlserve.deploy.preloaded import PRELOAD  # what a deployment's forked replicas preload

# read once, when a library loads (GNU OpenMP's and MKL's settings, rlserve's kernel switches): a server forked
# from the preloaded process keeps the values it loaded with, so one that asks for others is exec'd afresh
READ_AT_IMPORT = ("OMP_", "MKL_", "KMP_", "GOMP_", "TRITON_INTERPRET", "RLSERVE_GEMV_THREADS")
_preloaded_with: dict[str, str] | None = None


def _read_at_import(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT)}


def child_processes() -> multiprocessing.context.BaseContext:
    """The multiprocessing context for tests' engine and server processes: each child forks from one server
    process that imported PRELOAD once, where a spawned child imports them again (~5 s of CPU). Not plain fork: a
    pytest process has threads and has run torch ops, which a fork does not survive."""
    global _preloaded_with
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    if _preloaded_with is None:  # the forkserver starts at the first child, with this environment
        _preloaded_with = _read_at_import(dict(os.environ))
    return ctx


def can_fork_with(env: dict[str, str]) -> bool:
    """Whether a server with `env` may be forked from the preloaded process (it loaded what `env` sets alike)."""
    preloaded = _preloaded_with if _preloaded_with is not None else _read_at_import(dict(os.environ))
    return _read_at_import(env) == preloaded


def _run_cli(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: what `python -m rlserve.cli *argv` would be, its output to `log_path`."""
    import setproctitle

    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    # named before the environment changes: setproctitle finds the memory it rewrites next to the initial one
    setproctitle.setproctitle(" ".join([sys.executable, "-m", "rlserve.cli", *argv]))
    os.environ.clear()
    os.environ.update(env)
    from rlserve.cli import main

    sys.exit(main(argv))


class ForkedServer:
    """An `rlserve serve` forked from the preloaded process, with the part of subprocess.Popen's face tests use.
    Daemonic: one a failed test left running is stopped when its pytest worker exits."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.args, self.log_path = argv, log_path
        self._process = child_processes().Process(target=_run_cli, args=(argv, env, str(log_path)), daemon=True)
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
