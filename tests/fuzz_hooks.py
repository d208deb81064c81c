"""schemathesis hooks for tests/test_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

A fuzzed /pause would hold every later generation until a fuzzed /resume, and a fuzzed
/init_broadcaster would wait on a rendezvous with a made-up host: both are pointed back at safe
ground so the run tests validation, not timeouts."""

from __future__ import annotations

import os

import httpx
import schemathesis

BASE_URL = os.environ["RLSERVE_FUZZ_URL"]
CLOSED_PORT = int(os.environ["RLSERVE_FUZZ_CLOSED_PORT"])


@schemathesis.hook
def before_call(context, case, kwargs) -> None:
    if case.path == "/init_broadcaster" and isinstance(case.body, dict):
        case.body = {**case.body, "host": "127.0.0.1", "port": CLOSED_PORT, "timeout": 1}


@schemathesis.hook
def after_call(context, case, response) -> None:
    if case.path in ("/sleep", "/release_kv_cache_memory"):  # asleep, /resume is refused until woken
        httpx.post(f"{BASE_URL}/wake_up", timeout=60)
    if case.path == "/sleep" and str((case.query or {}).get("level")) == "2":  # the weights went: restore them
        httpx.post(f"{BASE_URL}/collective_rpc", json={"method": "reload_weights"}, timeout=120)
    if case.path in ("/pause", "/pause_generation", "/sleep", "/release_kv_cache_memory"):
        httpx.post(f"{BASE_URL}/resume", timeout=60)
