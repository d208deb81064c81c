"""Child processes of a deployment: started in their own process group (exec'd, or `rlserve.cli` forked from
the preloaded process: deploy/preloaded.py), every output line copied to ours with a prefix, and stopped with
their whole tree (SIGTERM and SIGCONT, then SIGKILL)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable

from rlserve.deploy.preloaded import CLI, ForkedCli, fork_cli
from rlserve.engine.child import die_with_parent

_URL_LINE = re.compile(r"rlserve: serving \S+ on (http://\S+)")


def _child_setup(cores: list[int] | None) -> Callable[[], None]:
    """Runs in the child before exec: its own session, death with the parent (SIGTERM if the supervisor dies
    without cleaning up, e.g. kill -9), and (if given) its cores, which every thread and process it starts
    inherits."""

    def setup() -> None:
        os.setsid()
        die_with_parent(os.getppid())
        if cores:
            os.sched_setaffinity(0, cores)

    return setup


class Child:
    """One child process; `name` prefixes its log lines; `on_line` sees each line (e.g. to find its URL).
    `preloaded`: `argv` is CLI + its arguments, forked from the preloaded process instead of exec'd."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        on_line: Callable[[str], None] | None = None,
        cores: list[int] | None = None,
        preloaded: bool = False,
    ):
        self.name, self.argv = name, argv
        if preloaded:
            assert argv[: len(CLI)] == CLI, argv
            self.proc: subprocess.Popen | ForkedCli = fork_cli(argv[len(CLI) :], env or dict(os.environ), cores)
        else:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                preexec_fn=_child_setup(cores),
            )
        self._on_line = on_line
        self._pump = threading.Thread(target=self._copy_lines, name=f"log-{name}", daemon=True)
        self._pump.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _copy_lines(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            sys.stdout.write(f"[{self.name}] {line}\n")
            sys.stdout.flush()
            if self._on_line is not None:
                self._on_line(line)

    def exited(self) -> int | None:
        return self.proc.poll()

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL what is left after grace_s. SIGCONT follows SIGTERM (as systemd
        sends it): a frozen process (SIGSTOP, the supervisor's usual reason to restart a replica that stopped
        answering) handles its SIGTERM only once continued, and would otherwise sit out the grace period."""
        if self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            self._signal_group(signal.SIGCONT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        self._signal_group(signal.SIGKILL)  # stragglers of the group, if any
        self.proc.wait()
        self._pump.join(timeout=5)

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            # no group yet: a forked child that has not reached its setsid (an exec'd one has, before exec)
            if self.proc.poll() is None:
                try:
                    os.kill(self.proc.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass


class ServerChild(Child):
    """An `rlserve serve` child: its URL is the one it prints once it listens."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        env: dict[str, str] | None = None,
        cores: list[int] | None = None,
        preloaded: bool = False,
    ):
        self.url: str | None = None
        self._listening = threading.Event()
        super().__init__(name, argv, env, on_line=self._watch, cores=cores, preloaded=preloaded)

    def _watch(self, line: str) -> None:
        match = _URL_LINE.search(line)
        if match and self.url is None:
            self.url = match.group(1)
            self._listening.set()

    def wait_listening(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not self._listening.wait(0.2):
            if self.exited() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.proc.returncode} before serving")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name} did not start serving within {timeout_s:.0f}s")
        assert self.url is not None
        return self.url
