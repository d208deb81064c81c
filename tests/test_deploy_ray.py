"""Multi-node on Ray: a local two-node cluster (1 CPU each, private ports and temp dir) serves through two
replicas behind the router, and one update through the admin address reaches both."""

from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile

import httpx
import pytest

from deploy_helpers import replicas, start_deployment, stop_deployment
from rlserve.model.make import make_model
from test_server_rl import generate, hf_check

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit
    # RAY_TMPDIR: not the shared /tmp/ray; the other: drivers see themselves at 127.0.0.1 like the nodes
    env = {"RAY_TMPDIR": temp_dir, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.makedirs(os.path.join(temp_dir, "ray"))
    node = {"num_cpus": 1, "object_store_memory": 80 << 20, "include_dashboard": False, "temp_dir": temp_dir,
            "node_ip_address": "127.0.0.1"}

    picked = iter(_distinct_free_ports(16))

    def ports() -> dict:  # never Ray's defaults: other test runs may be using them
        names = ("node_manager_port", "object_manager_port", "metrics_export_port", "metrics_agent_port",
                 "runtime_env_agent_port", "dashboard_agent_listen_port")
        return {name: next(picked) for name in names}

    c = Cluster(initialize_head=True, head_node_args={**node, **ports(), "gcs_server_port": next(picked)})
    try:
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
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def test_two_nodes_serve_through_the_router_and_take_one_update(cluster, tmp_path):
    step1 = make_model("tiny", tmp_path / "step-1", seed=1)
    public, admin, proc = start_deployment(
        "--deployment.type", "multi_node", "--deployment.num_nodes", "2", "--deployment.ray_address",
        cluster.address, "--num_threads", "1", "--weight_roots", json.dumps([str(tmp_path)]),
        "--engine.kv_cache_bytes", str(16 << 20), timeout=400)
    try:
        rows = replicas(admin)
        assert [r["status"] for r in rows] == ["serving", "serving"] and rows[0]["url"] != rows[1]["url"]
        for i in range(4):
            r = httpx.post(f"{public}/v1/completions", json={"prompt": [i + 1, 2], "max_tokens": 2},
                           headers={"X-Session-ID": f"s{i}"}, timeout=120)
            assert r.status_code == 200 and r.json()["choices"][0]["policy_version"] == 0
        r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(step1), "weight_version": "step-1"},
                       timeout=300)
        assert r.status_code == 200, r.text
        for row in replicas(admin):
            assert (row["policy_version"], row["weight_version"]) == (1, "step-1")
            hf_check(step1, [11, 22, 33], generate(row["url"], [11, 22, 33])["choices"][0])
    finally:
        stop_deployment(proc)
