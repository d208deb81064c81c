"""A deployment's local replicas forked from the preloaded process (deploy/preloaded.py): each start and restart
is a child of that one process, in a session of its own, named as the exec'd command would be; it serves, and a
replica killed is forked again. Killing the launcher with SIGKILL (no clean-up runs) takes the preloaded process
and every replica and engine with it. Only a replica whose environment is the launcher's, but for the key and
admin address it reads as it runs, is forked."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx

from deploy_helpers import alive, descendants, replicas, start_deployment, stop_deployment, wait_for
from rlserve.deploy.preloaded import can_fork
from rlserve.deploy.process import CLI, Child
from rlserve.deploy.replica import ADMIN_URL_ENV, KEY_ENV


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name: state, ppid, pgrp, session, ..."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _forked_replica(pid: int, preloaded: int) -> None:
    _, ppid, _, session = _stat(pid)[:4]
    assert int(ppid) == preloaded and int(session) == pid
    assert _cmdline(pid).startswith(" ".join([*CLI, "serve", "@"]))


def test_replicas_fork_from_the_preloaded_process_and_die_with_a_killed_launcher():
    public, admin, proc = start_deployment("--deployment.replicas", "2", "--engine.kv_cache_bytes", str(16 << 20))
    tree: list[int] = []
    try:
        (preloaded,) = [p for p in descendants(proc.pid) if "multiprocessing.forkserver" in _cmdline(p)]
        rows = sorted(replicas(admin), key=lambda r: r["index"])
        for row in rows:
            _forked_replica(row["pid"], preloaded)
        r = httpx.post(f"{public}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200, r.text

        os.kill(rows[0]["pid"], signal.SIGKILL)
        back = wait_for(
            lambda: [r for r in replicas(admin) if r["index"] == 0 and r["status"] == "serving" and r["restarts"] == 1],
            300,
            "replica 0's restart",
        )[0]
        assert back["pid"] != rows[0]["pid"]
        _forked_replica(back["pid"], preloaded)

        tree = descendants(proc.pid)
        assert len(tree) >= 6  # the preloaded process, two servers, their engines, the router
        proc.kill()  # no clean-up of its own: each process dies with its parent
        proc.wait(timeout=30)
        wait_for(lambda: not any(alive(pid) for pid in tree), 60, "every process of the killed deployment to exit")
    finally:
        stop_deployment(proc)
        for pid in tree:  # what outlived the launcher, when the check above failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_only_a_replica_with_the_launchers_environment_is_forked():
    env = {**os.environ, KEY_ENV: "k", ADMIN_URL_ENV: "http://127.0.0.1:1"}
    assert can_fork(env, read_at_run_time=(KEY_ENV, ADMIN_URL_ENV))
    assert not can_fork({**env, "OMP_NUM_THREADS": "7"}, read_at_run_time=(KEY_ENV, ADMIN_URL_ENV))
    assert not can_fork({**env, "HF_HOME": "/elsewhere"}, read_at_run_time=(KEY_ENV, ADMIN_URL_ENV))


def test_a_forked_cli_passes_its_output_and_exit_code():
    lines: list[str] = []
    child = Child("forked", [*CLI, "no-such-command"], dict(os.environ), on_line=lines.append, preloaded=True)
    try:
        assert child.proc.wait(timeout=300) == 2
        child.stop(grace_s=0)  # joins the line pump
        assert "rlserve: unknown command 'no-such-command'" in lines, lines
    finally:
        child.stop(grace_s=0)
