"""Starting a deployment (`rlserve serve --deployment.replicas N`) as a real process tree, for tests."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from conftest import SERVER_DEFAULTS, drop_log, server_log
from rlserve.runtime.ports import free_port

# the supervisor's /health probes of a deployment whose tests wait for a frozen replica to be taken out: 3 s a
# probe and 10 s to readmit one that answers again, not 10 s and 30 s ([deployment.health_check])
QUICK_PROBES = ("--deployment.health_check.timeout_s", "3", "--deployment.health_check.readmit_timeout_s", "10")
_READY = re.compile(r"rlserve: serving \S+ on (http://\S+) \(.*admin: (http://[^\s)]+)\)")


def start_deployment(*args: str, timeout: float = 300.0) -> tuple[str, str, subprocess.Popen]:
    """(public URL, admin URL, supervisor process) once the router and the admin address answer."""
    fd, log_path = tempfile.mkstemp(prefix="rlserve-test-deploy-", suffix=".log")
    env = {k: v for k, v in os.environ.items() if k not in ("RLSERVE_API_KEY", "VLLM_API_KEY")}
    cmd = [
        sys.executable,
        "-m",
        "rlserve.cli",
        "serve",
        "--server.host",
        "127.0.0.1",
        "--server.port",
        "0",
        *SERVER_DEFAULTS,
        *args,
    ]
    with os.fdopen(fd, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    proc.log_path = Path(log_path)  # type: ignore[attr-defined]
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"deployment exited with code {proc.returncode}:\n{server_log(proc)[-5000:]}")
            match = _READY.search(server_log(proc))
            if match and httpx.get(f"{match.group(2)}/health", timeout=5).status_code == 200:
                return match.group(1), match.group(2), proc
            time.sleep(0.2)
        raise RuntimeError(f"deployment not up after {timeout:.0f}s:\n{server_log(proc)[-5000:]}")
    except BaseException:
        stop_deployment(proc)
        raise


def stop_deployment(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for pid in descendants(proc.pid):
                os.kill(pid, signal.SIGKILL)
            proc.kill()
            proc.wait()
    drop_log(proc, tail=30000)


def sigterm_leaves_nothing(proc: subprocess.Popen, tree: list[int], within: float, what: str) -> None:
    """SIGTERM the deployment: it exits 0 and every process of `tree` (its children, the router, servers on Ray
    nodes) is gone within `within` seconds; what is left when a check fails is stopped by force."""
    proc.send_signal(signal.SIGTERM)
    try:
        assert proc.wait(timeout=120) == 0, server_log(proc)[-4000:]
        wait_for(lambda: not any(alive(pid) for pid in tree), within, what)
    finally:
        stop_deployment(proc)


@contextlib.contextmanager
def two_replicas_under(root: Path, *args: str) -> Iterator[tuple[str, str, subprocess.Popen]]:
    """(public url, admin url, process) of a two-replica deployment that loads weights under `root` (`args`:
    more of its command line)."""
    public, admin, proc = start_deployment(
        "--deployment.replicas",
        "2",
        "--weight_roots",
        json.dumps([str(root)]),
        "--engine.kv_cache_bytes",
        str(16 << 20),
        *args,
    )
    try:
        yield public, admin, proc
    finally:
        stop_deployment(proc)


def rejoined(admin: str, victim: dict) -> dict | None:
    """The victim's row once its next incarnation serves; fails at once if it sits out instead."""
    (row,) = [r for r in replicas(admin) if r["index"] == victim["index"]]
    assert row["status"] != "stale", f"{row['url']} sits out: {row['detail']}"
    if row["status"] == "serving" and row["restarts"] > victim["restarts"]:
        return row
    return None


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """Every live process under pid (Linux /proc), children first."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def replicas(admin_url: str) -> list[dict]:
    return httpx.get(f"{admin_url}/deployment", timeout=30).json()["replicas"]


def wait_for(condition, timeout: float = 300.0, what: str = "condition", show=None):
    """Poll until condition() is truthy (a hang guard, not a speed budget); `show()`, where given, says in the
    failure what was seen last (a deployment's replica rows, say)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    seen = f"; last seen: {show()}" if show is not None else ""
    raise AssertionError(f"timed out waiting for {what}{seen}")


@contextlib.contextmanager
def one_at_a_time(name: str) -> Iterator[None]:
    """Held by one xdist worker of this test run at a time (a file lock the run's workers share): for what a
    small machine can host only once, such as a local Ray cluster with its nodes' servers."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))
    with open(Path(tempfile.gettempdir()) / f"rlserve-tests-{name}-{run}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


@contextlib.contextmanager
def local_ray_cluster(num_nodes: int) -> Iterator:
    """A Ray cluster of num_nodes node processes on this machine (1 CPU each, private ports and temp dir), one at a
    time per test run: two clusters with their servers on two cores at once are what CI's only failures of these
    modules had in common (both modules' tests failed together, side by side, three runs in a row)."""
    with one_at_a_time("ray-cluster"):
        with _local_ray_cluster(num_nodes) as cluster:
            yield cluster


@contextlib.contextmanager
def _local_ray_cluster(num_nodes: int) -> Iterator:
    from ray.cluster_utils import Cluster

    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit
    # RAY_TMPDIR: not the shared /tmp/ray; the second: drivers see themselves at 127.0.0.1 like the nodes; the
    # last: Ray runs its workers at nice 15 (to keep its raylet responsive), which on a test machine shared with
    # the other xdist worker starves every server a node hosts behind that worker's nice-0 processes
    env = {"RAY_TMPDIR": temp_dir, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_worker_niceness": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.makedirs(os.path.join(temp_dir, "ray"))
    node = {
        "num_cpus": 1,
        "object_store_memory": 80 << 20,
        "include_dashboard": False,
        "temp_dir": temp_dir,
        "node_ip_address": "127.0.0.1",
    }
    picked = iter(_distinct_free_ports(6 * num_nodes + 1))

    def ports() -> dict:  # never Ray's defaults: other test runs may be using them
        names = (
            "node_manager_port",
            "object_manager_port",
            "metrics_export_port",
            "metrics_agent_port",
            "runtime_env_agent_port",
            "dashboard_agent_listen_port",
        )
        return {name: next(picked) for name in names}

    c = Cluster(initialize_head=True, head_node_args={**node, **ports(), "gcs_server_port": next(picked)})
    try:
        for _ in range(num_nodes - 1):
            c.add_node(**node, **ports())
        c.wait_for_nodes()
        yield c
    finally:
        c.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _distinct_free_ports(n: int) -> list[int]:
    return [free_port() for _ in range(n)]
