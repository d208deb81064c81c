"""The server process: admin routes closed by default off loopback, and SIGTERM drains (503 to new
work, in-flight requests finish or are aborted after the grace period), exits 0, leaves no child."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest

from conftest import SERVER_DEFAULTS, server_log, start_server, stop_server, wait_queued
from rlserve.config.schema import Config
from rlserve.server.listen import bind, check_admin_exposure


def test_open_host_without_admin_key_refuses_to_start():
    # the check runs before anything binds: nothing is ever served on 0.0.0.0 here
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "rlserve.cli",
            "serve",
            "--server.host",
            "0.0.0.0",
            "--server.port",
            "0",
            *SERVER_DEFAULTS,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "server.admin_api_key" in proc.stderr and "--server.allow_open_admin true" in proc.stderr
    assert "rlserve: serving" not in proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "host, extra, ok",
    [
        ("0.0.0.0", {}, False),
        ("::", {}, False),
        ("0.0.0.0", {"admin_api_key": "k"}, True),
        ("0.0.0.0", {"allow_open_admin": True}, True),
        ("127.0.0.1", {}, True),
        ("127.0.0.2", {}, True),
        ("::1", {}, True),
        ("localhost", {}, True),
    ],
)
def test_admin_exposure_rule(host, extra, ok):
    config = Config(server={"host": host, **extra})
    if ok:
        check_admin_exposure(config)
    else:
        with pytest.raises(SystemExit, match="admin_api_key"):
            check_admin_exposure(config)


def test_keys_are_checked_on_every_admin_route_form():
    url, proc = start_server("--server.admin_api_key", "s3cret")
    try:
        for headers in (
            {},
            {"Authorization": "Bearer s3cre"},
            {"Authorization": "Bearer s3cret-longer"},
            {"Authorization": "Basic s3cret"},
            {"Authorization": "Bearer s\xe9cret".encode("latin-1")},
        ):
            assert httpx.post(f"{url}/pause", headers=headers).status_code == 401
        assert httpx.post(f"{url}/resume", headers={"Authorization": "Bearer s3cret"}).status_code == 200
    finally:
        stop_server(proc)


def _held_request(url: str, out: dict) -> threading.Thread:
    """A completion frozen by /pause?mode=keep: it cannot finish until resumed or aborted."""
    assert httpx.post(f"{url}/pause", params={"mode": "keep"}).status_code == 200
    body = {"prompt": [1, 2, 3], "max_tokens": 20, "ignore_eos": True, "temperature": 0}
    thread = threading.Thread(target=lambda: out.update(r=httpx.post(f"{url}/v1/completions", json=body, timeout=120)))
    thread.start()
    wait_queued(url, 1)
    return thread


def _wait_draining(url: str) -> None:
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health").status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def _children(proc: subprocess.Popen) -> list[psutil.Process]:
    return psutil.Process(proc.pid).children(recursive=True)


def _gone(children: list[psutil.Process]) -> bool:
    return all(not c.is_running() or c.status() == psutil.STATUS_ZOMBIE for c in children)


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones():
    url, proc = start_server("--server.shutdown_grace_s", "120", fresh=True)
    try:
        out: dict = {}
        thread = _held_request(url, out)
        children = _children(proc)
        proc.send_signal(signal.SIGTERM)
        _wait_draining(url)
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1})
        assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
        assert httpx.post(f"{url}/resume").status_code == 200  # admin routes still work while draining
        thread.join(timeout=120)
        choice = out["r"].json()["choices"][0]
        assert out["r"].status_code == 200 and choice["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
        assert _gone(children)
    finally:
        stop_server(proc)


def test_sigterm_aborts_what_is_still_running_after_the_grace_period():
    url, proc = start_server("--server.shutdown_grace_s", "1", fresh=True)
    try:
        out: dict = {}
        thread = _held_request(url, out)  # never resumed
        children = _children(proc)
        proc.send_signal(signal.SIGTERM)
        thread.join(timeout=120)
        assert out["r"].status_code == 200 and out["r"].json()["choices"][0]["finish_reason"] == "abort"
        assert proc.wait(timeout=60) == 0
        assert _gone(children)
    finally:
        stop_server(proc)


def test_a_sigterm_that_reaches_the_engine_process_too_is_a_clean_stop():
    """A supervisor that stops a server signals its process group (the deployment's, systemd's control group), so
    the engine process ends on the same SIGTERM while the server drains: that is the stop asked for, not an
    engine death, and the server exits 0 (an engine that dies on its own still exits ENGINE_DIED_EXIT_CODE,
    tests/faults/test_engine_killed.py). The engine's SIGTERM comes once the server drains, by construction."""
    url, proc = start_server("--server.shutdown_grace_s", "120", fresh=True)
    try:
        out: dict = {}
        thread = _held_request(url, out)  # keeps the drain going until the engine ends
        children = _children(proc)
        proc.send_signal(signal.SIGTERM)
        _wait_draining(url)
        for child in children:
            child.send_signal(signal.SIGTERM)
        thread.join(timeout=120)
        assert out["r"].status_code in (200, 503)  # aborted, or cut off with the engine; answered either way
        assert proc.wait(timeout=60) == 0
        assert _gone(children)
        log = server_log(proc)
        assert "the engine is gone" not in log
        assert "engine core is gone" in log and not [ln for ln in log.splitlines() if "ERROR" in ln]
    finally:
        stop_server(proc)


def test_the_printed_address_accepts_connections_before_the_server_loop_runs():
    """The URL line is printed before uvicorn starts: a client that reads it and connects at once (a supervisor,
    a test, on a machine where this process gets no CPU for a while) must queue, not be refused."""
    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=10):
            pass  # nobody has called accept(): the kernel's backlog holds it
    finally:
        sock.close()
