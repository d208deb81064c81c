"""The 400s of the RL control routes added with weight transfer, sleep mode, in-flight policies and the
adapter checks: each row of docs/errors.md's "RL control routes" table sent to a running server (status and
message fragment), and each row present in the table. The adapter rows are sent by
tests/faults/test_refused_configs.py."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import assert_documented_error, start_server, stop_server

INFO = {"names": ["x"], "dtype_names": ["float32"], "shapes": [[1]]}
INIT = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}

# (case, route, query, body, status, fragment of error.message)
ROWS = [
    ("inflight-policy-unknown", "/update_weights", {}, {"weight_dir": "/x", "inflight_update_policy": "sometimes"},
     400, "inflight_update_policy"),
    ("inflight-policy-finish", "/finish_weight_update", {}, {"inflight_update_policy": "sometimes"},
     400, "inflight_update_policy"),
    ("update-info-shape", "/update_weights", {}, {"update_info": {"names": []}}, 400, "update_info needs names"),
    ("update-info-dtype", "/update_weights", {}, {"update_info": {**INFO, "dtype_names": ["int64"]}}, 400,
     "cannot carry weights"),
    ("update-info-checksums", "/update_weights", {}, {"update_info": {**INFO, "checksums": {"x": 1}}}, 400,
     "update_info.checksums must map"),
    ("init-info-missing", "/init_weight_transfer_engine", {}, {"init_info": {"master_address": "127.0.0.1"}}, 400,
     "init_info is missing"),
    ("init-info-rank", "/init_weight_transfer_engine", {}, {"init_info": {**INIT, "rank_offset": 0}}, 400,
     "must lie in [1, world_size"),
    ("init-info-packed", "/init_weight_transfer_engine", {}, {"init_info": {**INIT, "packed": "yes"}}, 400,
     "packed must be true or false"),
    ("weight-checker-action", "/weight_checker", {}, {"action": "x"}, 400, "action must be checksum, reset or compare"),
    ("weight-checker-baseline", "/weight_checker", {}, {"action": "compare"}, 400, "requires a 'baseline' object"),
    ("sleep-level", "/sleep", {"level": "5"}, None, 400, "level must be 0, 1 or 2"),
    ("wake-up-tags", "/wake_up", {"tags": "disk"}, None, 400, "unknown tags"),
    ("collective-rpc-method", "/collective_rpc", {}, {"method": "exec"}, 400, "is not allowed"),
    ("collective-rpc-args", "/collective_rpc", {}, {"method": "reset_prefix_cache", "args": [1]}, 400,
     "takes no args or kwargs"),
    ("pause-mode", "/pause", {"mode": "later"}, None, 400, "mode must be keep, abort or wait"),
    ("resume-steps", "/resume", {"steps": "0"}, None, 400, "steps must be a whole number of at least 1"),
]  # fmt: skip
# sent by tests/faults/test_refused_configs.py
ADAPTER_ROWS = [
    ("adapter-not-plain-lora", "/v1/load_lora_adapter", 400, "use_dora"),
    ("adapter-config-not-json", "/v1/load_lora_adapter", 400, "is not JSON"),
]


@pytest.fixture(scope="module")
def server():
    url, proc = start_server()
    try:
        yield url
    finally:
        stop_server(proc)


@pytest.mark.parametrize("row", ROWS, ids=[r[0] for r in ROWS])
def test_control_route_refusal(server, row):
    _, route, query, body, status, fragment = row
    r = httpx.post(f"{server}{route}", params=query, content=json.dumps(body or {}), timeout=60)
    assert r.status_code == status, r.text
    assert fragment in r.json()["error"]["message"]


@pytest.mark.parametrize("row", [(c, r, s, f) for c, r, _, _, s, f in ROWS] + ADAPTER_ROWS, ids=lambda r: r[0])
def test_control_route_refusal_is_documented(row):
    assert_documented_error(*row)
