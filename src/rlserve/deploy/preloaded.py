"""A deployment's local replicas forked from one process that imported the server stack once (multiprocessing's
forkserver with torch, transformers, the engine and the server preloaded). A fresh `python -m rlserve.cli serve`
spends ~6 s of CPU importing them, at every start and every restart of a replica; a forked one starts at its config.

Libraries read some settings from the environment once, as they load (GNU OpenMP, MKL, Hugging Face's paths), so
only a replica whose environment equals the one the preloaded process started with, but for what the server reads
as it runs, is forked; any other is exec'd afresh (deploy/process.py decides)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import runpy
import subprocess
import sys
import threading
from multiprocessing.connection import Connection, wait

import setproctitle

from rlserve.engine.child import die_with_parent

# "__main__": a launcher run as a script (a Ray worker's default_worker.py) is imported once here, not again by
# every child as multiprocessing prepares it
PRELOAD = ["__main__", "torch", "transformers", "rlserve.engine.engine", "rlserve.server.app"]
CLI = [sys.executable, "-m", "rlserve.cli"]  # the command a replica runs, exec'd or (named so) forked
_preloaded_env: dict[str, str] | None = None  # the environment the preloaded process started with


def can_fork(env: dict[str, str], read_at_run_time: tuple[str, ...]) -> bool:
    """Whether a server with `env` may be forked: on Linux, with the environment the preloaded process has (or
    would start with), but for the names in `read_at_run_time`."""
    if not sys.platform.startswith("linux"):
        return False
    started = _preloaded_env if _preloaded_env is not None else dict(os.environ)

    def relevant(e: dict[str, str]) -> dict[str, str]:
        return {k: v for k, v in e.items() if k not in read_at_run_time}

    return relevant(env) == relevant(started)


def fork_cli(argv: list[str], env: dict[str, str], cores: list[int] | None = None) -> ForkedCli:
    """`python -m rlserve.cli *argv` forked from the preloaded process: in a session of its own, dying with that
    process (which dies with this one), on `cores` if given, its output on the returned process's `stdout`."""
    global _preloaded_env
    ctx = multiprocessing.get_context("forkserver")
    if _preloaded_env is None:  # the forkserver starts at the first child, with this environment
        ctx.set_forkserver_preload(PRELOAD)
        _preloaded_env = dict(os.environ)
    read_end, write_end = os.pipe()
    out = Connection(write_end, readable=False)  # passed to the child as a file descriptor
    try:
        process = ctx.Process(target=_run_cli, args=(argv, env, out, cores), daemon=True)
        process.start()
    except BaseException:
        os.close(read_end)
        raise
    finally:
        out.close()
    return ForkedCli(process, os.fdopen(read_end, "rb"), argv)


def _run_cli(argv: list[str], env: dict[str, str], out: Connection, cores: list[int] | None) -> None:
    """In the forked child: what `python -m rlserve.cli *argv` would be under deploy/process.py's Child."""
    preloaded = os.getppid()
    os.setsid()
    _let_the_preloaded_process_die_with_the_launcher()
    if not die_with_parent(preloaded):  # it died before prctl took effect
        os._exit(1)
    if cores:
        os.sched_setaffinity(0, cores)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    out.close()
    for stream in (sys.stdout, sys.stderr):  # a line at a time, so the parent sees the URL line when it is printed
        stream.reconfigure(line_buffering=True)
    # named before the environment changes: setproctitle finds the memory it rewrites next to the initial one
    setproctitle.setproctitle(" ".join([*CLI, *argv]))
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0], *argv]
    runpy.run_module("rlserve.cli", run_name="__main__", alter_sys=True)  # as `python -m` runs it


def _let_the_preloaded_process_die_with_the_launcher() -> None:
    """multiprocessing hands each child a copy of the forkserver's "alive" pipe, so that the child could start
    processes the same way; the forkserver exits once every copy is closed. A replica starts none, and had it kept
    its copy, a killed launcher would leave the forkserver waiting for the replica and the replica (dying with the
    forkserver, by PDEATHSIG) waiting for the forkserver."""
    server = multiprocessing.forkserver._forkserver
    alive = getattr(server, "_forkserver_alive_fd", None)
    if alive is not None:
        os.close(alive)
        server._forkserver_alive_fd = None


class ForkedCli:
    """A forked `rlserve.cli` with the part of subprocess.Popen's face deploy/process.py uses."""

    def __init__(self, process: multiprocessing.Process, stdout, argv: list[str]):
        self._process, self.stdout, self.args = process, stdout, argv
        self.pid: int = process.pid  # type: ignore[assignment]
        # the supervisor's watch loop and a stop may ask at once; the exit status can be read only once
        self._reaping = threading.Lock()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._reaping:
            return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        wait([self._process.sentinel], timeout)
        code = self.poll()
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code
