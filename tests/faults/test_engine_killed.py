"""The engine core process is killed (SIGKILL) while requests stream: every request in flight ends at once with
a clear error (never a hang), and the server exits with code 3 so its supervisor starts a fresh replica
(docs/faults.md). Only processes this test started are signalled, by PID.

The streams are mid-decode by construction, not by timing: they queue behind a pause, one engine step
(`/resume?steps=1`) gives each its first token and freezes the engine again, and the kill lands then."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import psutil

from conftest import server_log, start_server, stop_server, wait_queued

STREAMS = 3


def engine_core_pid(server_pid: int) -> int:
    cores = [p for p in psutil.Process(server_pid).children() if "rlserve.runtime.core" in " ".join(p.cmdline())]
    assert len(cores) == 1, cores
    return cores[0].pid


def test_engine_killed_mid_stream_fails_every_request_and_the_server_exits_nonzero() -> None:
    url, proc = start_server()
    try:
        assert httpx.post(f"{url}/pause", params={"mode": "keep"}, timeout=120).status_code == 200
        started = threading.Barrier(STREAMS + 1)
        results: list[dict] = [{} for _ in range(STREAMS)]

        def stream(i: int) -> None:
            body = {"prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True}
            chunks, error, first = 0, None, True
            try:
                with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(120)) as r:
                    results[i]["status"] = r.status_code
                    for line in r.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            error = event["error"]
                        else:
                            chunks += 1
                        if first:
                            first = False
                            started.wait(timeout=120)
            except httpx.HTTPError as exc:
                error = {"transport": repr(exc)}
            results[i].update(chunks=chunks, error=error)

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(STREAMS)]
        for t in threads:
            t.start()
        wait_queued(url, STREAMS)
        r = httpx.post(f"{url}/resume", params={"steps": 1}, timeout=120)
        assert r.json() == {"status": "paused", "steps": 1}, r.text
        started.wait(timeout=120)  # every stream has its first token, and the engine is frozen: all are mid-decode
        os.kill(engine_core_pid(proc.pid), signal.SIGKILL)
        for t in threads:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in threads), "a stream hung after the engine died"
        for r in results:
            assert r["status"] == 200 and r["chunks"] == 1, r
            assert r["error"] is not None and r["error"].get("code") == 503 and "engine" in r["error"]["message"], r
        assert proc.wait(timeout=120) == 3
        log = server_log(proc)
        assert "stopping with exit code 3" in log
    finally:
        stop_server(proc)


def test_requests_after_the_engine_died_get_503_until_the_server_has_exited() -> None:
    url, proc = start_server()
    try:
        os.kill(engine_core_pid(proc.pid), signal.SIGKILL)
        # whatever is still answered before the exit is a 503, never a hang or a 200
        for _ in range(50):
            if proc.poll() is not None:
                break
            try:
                r = httpx.post(f"{url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
            except httpx.TransportError:
                break  # the listening socket is closed: the server is on its way out
            assert r.status_code == 503, r.text
        assert proc.wait(timeout=120) == 3
    finally:
        stop_server(proc)
