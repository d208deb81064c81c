"""Client routing and error typing without servers: rendezvous hashing, least-busy choice, error kinds."""

from __future__ import annotations

from collections import Counter

import pytest

from rlserve.client import BadRequest, ContextLengthExceeded, InferenceClient, ServerError
from rlserve.client.endpoints import Pool
from rlserve.client.errors import error_for

URLS = ["http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000/v1/"]


def owners(pool: Pool, sessions: list[str]) -> dict[str, str]:
    return {s: pool.pick(s, check_versions=True).url for s in sessions}


def test_sessions_spread_and_only_a_removed_endpoints_sessions_move():
    pool = Pool(URLS, probe_interval=5)
    sessions = [f"traj-{i}" for i in range(3000)]
    before = owners(pool, sessions)
    assert set(before.values()) == {"http://10.0.0.1:8000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"}
    assert min(Counter(before.values()).values()) > 850  # about a third each
    assert owners(Pool(URLS, probe_interval=5), sessions) == before  # stable across clients and processes

    gone = pool.endpoints[1]
    gone.went_down()
    after = owners(pool, sessions)
    moved = {s for s in sessions if after[s] != before[s]}
    assert moved == {s for s in sessions if before[s] == gone.url}
    gone.up = True
    assert owners(pool, sessions) == before  # back where they were once it is healthy


def test_calls_without_session_go_to_the_least_busy_and_behind_endpoints_are_skipped():
    pool = Pool(URLS, probe_interval=5)
    a, b, c = pool.endpoints
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert pool.pick(None, check_versions=True) is b
    assert pool.pick(None, check_versions=True, avoid=b) is c
    b.observed(4)
    b.probed(0, paused=False)  # restarted: it served version 4 before, now reports 0
    assert b.behind and pool.pick(None, check_versions=True) is c
    assert pool.pick(None, check_versions=False) is b
    b.committed(1)  # weights pushed again through the client
    assert not b.behind


def test_bad_arguments_fail_early():
    with pytest.raises(ValueError, match="duplicate"):
        Pool(["http://a:1", "http://a:1/v1"], probe_interval=5)
    with pytest.raises(ValueError, match="on_overflow"):
        InferenceClient("http://a:1", on_overflow="crash")


def test_error_kinds_follow_the_status_and_message():
    body = {"error": {"message": "this model's maximum context length is 512 tokens", "code": 400}}
    assert isinstance(error_for(400, body, "", "u"), ContextLengthExceeded)
    other = error_for(404, {"error": {"message": "no such model"}}, "", "u")
    assert type(other) is BadRequest and other.message == "no such model" and other.status == 404
    assert isinstance(error_for(503, "busy", "busy", "u"), ServerError)
    assert isinstance(error_for(401, {"error": "Unauthorized"}, "", "u"), BadRequest)
