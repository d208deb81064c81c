"""Multi-node on Ray: a local two-node cluster (1 CPU each, private ports and temp dir) serves through two
replicas behind the router, and one update through the admin address reaches both; disaggregated on Ray
puts a prefill server on one node and a decode server on the other, their answers equal a single server's,
and SIGTERM leaves no process behind. Under Wide-EP a trainer's push is kept as one sharded copy that every
node's server writes its part of, and a server killed afterwards restarts from it at the pushed version."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from pathlib import Path
from urllib.parse import urlparse

import httpx
import numpy as np
import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from conftest import start_server, stop_server
from deploy_helpers import (
    alive,
    descendants,
    local_ray_cluster,
    rejoined,
    replicas,
    sigterm_leaves_nothing,
    start_deployment,
    stop_deployment,
    wait_for,
)
from rlserve.model.make import default_model_dir, make_model
from rlserve.runtime.weight_snapshot import INDEX_FILE
from rlserve.train import patch, token_logprobs
from test_moe import hf_experts
from test_pd import BLOCK, completion, metric, prompts, same_choice, warm
from test_server_moe import decode
from test_server_rl import TRAINER, choice_lps, generate, hf_check, trainer_push

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster(num_nodes=2) as c:
        yield c


def _replica_configs() -> set[Path]:
    return set(Path(tempfile.gettempdir()).glob("rlserve-replica-*"))


def test_two_nodes_serve_through_the_router_and_take_one_update(cluster, tmp_path):
    step1 = make_model("tiny", tmp_path / "step-1", seed=1)
    configs_before = _replica_configs()
    public, admin, proc = start_deployment(
        "--deployment.type",
        "multi_node",
        "--deployment.num_nodes",
        "2",
        "--deployment.ray_address",
        cluster.address,
        "--num_threads",
        "1",
        "--weight_roots",
        json.dumps([str(tmp_path)]),
        "--engine.kv_cache_bytes",
        str(16 << 20),
        timeout=400,
    )
    try:
        rows = replicas(admin)
        assert [r["status"] for r in rows] == ["serving", "serving"] and rows[0]["url"] != rows[1]["url"]
        assert _replica_configs() <= configs_before, "a node kept its replica's config file (it may hold API keys)"
        for i in range(4):
            r = httpx.post(
                f"{public}/v1/completions",
                json={"prompt": [i + 1, 2], "max_tokens": 2},
                headers={"X-Session-ID": f"s{i}"},
                timeout=120,
            )
            assert r.status_code == 200 and r.json()["choices"][0]["policy_version"] == 0
        r = httpx.post(
            f"{admin}/update_weights", json={"weight_dir": str(step1), "weight_version": "step-1"}, timeout=300
        )
        assert r.status_code == 200, r.text
        for row in replicas(admin):
            assert (row["policy_version"], row["weight_version"]) == (1, "step-1")
            hf_check(step1, [11, 22, 33], generate(row["url"], [11, 22, 33])["choices"][0])
    finally:
        stop_deployment(proc)


def test_disaggregated_on_ray_serves_through_p_and_d_nodes_and_sigterm_leaves_nothing(cluster):
    single_url, single = start_server("--num_threads", "1", "--engine.kv_cache_bytes", str(16 << 20))
    public, admin, proc = start_deployment(
        "--deployment.type",
        "disaggregated",
        "--deployment.num_prefill_nodes",
        "1",
        "--deployment.num_decode_nodes",
        "1",
        "--deployment.ray_address",
        cluster.address,
        "--num_threads",
        "1",
        "--engine.kv_cache_bytes",
        str(16 << 20),
        timeout=400,
    )
    try:
        rows = sorted(replicas(admin), key=lambda r: r["index"])
        assert [(r["role"], r["status"]) for r in rows] == [("prefill", "serving"), ("decode", "serving")]
        p, d = rows[0]["url"], rows[1]["url"]
        lengths = [40, 100]
        for prompt in prompts(11, lengths):
            warm(single_url, prompt)
            same_choice(completion(public, prompt)["choices"][0], completion(single_url, prompt)["choices"][0])
        assert metric(d, "rlserve:kv_transfer_tokens_total") == sum((n - 1) // BLOCK * BLOCK for n in lengths)
        assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == 0
        # P's block server listens on its node's IP, the address it tells D
        (prompt,) = prompts(12, [50])
        body = {"prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        kt = httpx.post(f"{p}/v1/completions", json=body, timeout=120).json()["kv_transfer_params"]
        assert kt["remote_host"] == urlparse(p).hostname
        # a prefill server that dies is restarted on its node and rejoins the router as a prefill server
        os.kill(rows[0]["pid"], signal.SIGKILL)
        rows = wait_for(lambda: _all_serving_after_restart(admin), 300, "the prefill server to rejoin")
        (prompt,) = prompts(13, [70])
        warm(single_url, prompt)
        same_choice(completion(public, prompt)["choices"][0], completion(single_url, prompt)["choices"][0])
        assert metric(rows[1]["url"], "rlserve:kv_transfer_local_fallbacks_total") == 0
        router_pid = httpx.get(f"{admin}/deployment", timeout=30).json()["router_pid"]
        tree = [*descendants(proc.pid), router_pid, *(r["pid"] for r in rows)]
        assert all(tree) and all(alive(pid) for pid in (router_pid, rows[0]["pid"], rows[1]["pid"]))
    except BaseException:
        stop_deployment(proc)
        raise
    finally:
        stop_server(single)
    sigterm_leaves_nothing(proc, tree, 60, "every server and the router to exit")


def _all_serving_after_restart(admin: str) -> list[dict] | None:
    rows = sorted(replicas(admin), key=lambda r: r["index"])
    restarted = [r["restarts"] for r in rows] == [1, 0] and all(r["status"] == "serving" for r in rows)
    return rows if restarted else None


def _raylet_above(pid: int, raylets: set[int]) -> int | None:
    """The Ray node's raylet among pid's ancestors: the node that runs the process."""
    while pid > 1:
        if pid in raylets:
            return pid
        pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
    return None


def _raylets(cluster) -> set[int]:
    return {p.pid for node in cluster.list_all_nodes() for name, p in node.live_processes() if name == "raylet"}


def _tp_workers(cluster) -> list[int]:
    """Tensor-parallel worker processes on this cluster's nodes (not other tests' local ones)."""
    found, raylets = [], _raylets(cluster)
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and b"rlserve.engine.tp.worker" in open(f"/proc/{entry}/cmdline", "rb").read():
                if _raylet_above(int(entry), raylets) is not None:
                    found.append(int(entry))
        except OSError:
            continue
    return found


def _one_replica_over_both_nodes(cluster, *args: str):
    """A multi_node deployment of one tp=2 replica spanning the cluster's two nodes, one rank on each."""
    return start_deployment(
        "--deployment.type",
        "multi_node",
        "--deployment.num_nodes",
        "2",
        "--deployment.nodes_per_replica",
        "2",
        "--parallel.tp",
        "2",
        "--deployment.ray_address",
        cluster.address,
        "--engine.kv_cache_bytes",
        str(16 << 20),
        *args,
        timeout=400,
    )


def test_a_replica_spanning_two_nodes_matches_transformers_and_stops_whole(cluster, tmp_path):
    """One tp=2 replica over both nodes: rank 0 (and its HTTP server) on one, rank 1 on the other, the ranks
    talking over gloo; its answers match transformers before and after an update that both ranks stage, and after
    the remote rank is killed and the replica restarted; SIGTERM ends the processes on both nodes."""
    step1 = make_model("tiny", tmp_path / "step-1", seed=1)
    public, admin, proc = _one_replica_over_both_nodes(cluster, "--weight_roots", json.dumps([str(tmp_path)]))
    try:
        (row,) = replicas(admin)
        (worker,) = _tp_workers(cluster)
        raylets = _raylets(cluster)
        server_node, worker_node = _raylet_above(row["pid"], raylets), _raylet_above(worker, raylets)
        assert None not in (server_node, worker_node) and server_node != worker_node
        default = default_model_dir()
        for prompt in ([11, 22, 33, 44, 55], [100, 7, 300, 9]):
            hf_check(default, prompt, generate(public, prompt)["choices"][0])
        r = httpx.post(f"{admin}/update_weights", json={"weight_dir": str(step1)}, timeout=300)
        assert r.status_code == 200, r.text
        choice = generate(public, [11, 22, 33])["choices"][0]
        assert choice["policy_version"] == 1
        hf_check(step1, [11, 22, 33], choice)
        # the remote rank dies: the replica fails as a whole, restarts on its two bundles and rejoins at step 1
        os.kill(worker, signal.SIGKILL)
        wait_for(
            lambda: replicas(admin)[0]["restarts"] == 1 and replicas(admin)[0]["status"] == "serving", 300, "a restart"
        )
        (worker,) = _tp_workers(cluster)
        row = replicas(admin)[0]
        choice = generate(public, [11, 22, 33])["choices"][0]
        assert choice["policy_version"] == 1
        hf_check(step1, [11, 22, 33], choice)
    finally:
        stop_deployment(proc)
    wait_for(lambda: not alive(worker) and not alive(row["pid"]), 120, "both nodes' processes to exit")


def test_wide_ep_one_moe_replica_with_its_experts_on_two_nodes(cluster, tmp_path):
    """Expert parallelism across nodes (prime-rl's Wide-EP): each node's rank holds half of every layer's experts,
    tokens reach them by all-to-all over gloo between the nodes; the answers and the routed experts (router
    replay) match transformers."""
    moe = make_model("tiny-moe", tmp_path / "tiny-moe", seed=0)
    public, admin, proc = _one_replica_over_both_nodes(
        cluster, "--model.name", str(moe), "--parallel.enable_expert_parallel", "true", "--enable_return_routed_experts"
    )
    try:
        (worker,) = _tp_workers(cluster)
        raylets = _raylets(cluster)
        assert _raylet_above(worker, raylets) != _raylet_above(replicas(admin)[0]["pid"], raylets)
        hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
        for prompt in ([11, 22, 33, 44, 55], [100, 7, 300, 9]):
            choice = generate(public, prompt)["choices"][0]
            hf_check(moe, prompt, choice)
            forwarded = (prompt + choice["token_ids"])[:-1]  # the router choices of every forwarded token
            np.testing.assert_array_equal(decode(choice["routed_experts"]), hf_experts(hf, forwarded))
    finally:
        stop_deployment(proc)
    wait_for(lambda: not alive(worker), 120, "the remote rank to exit")


def test_wide_ep_one_expert_group_over_the_servers_of_two_nodes(cluster, tmp_path):
    """prime-rl's Wide-EP shape (multi_node, enable_expert_parallel, parallel.dp counted over all nodes): one
    server per node, each with dp / nodes engines, all of them one expert group. A request served on one node
    makes the other node's engine step with it (a dummy forward) and exchange tokens over gloo; answers and
    routed experts match transformers. In batch-invariant mode, as here, the logprobs are the trainer's patched
    transformers model's bit for bit, whichever node's experts computed them."""
    moe = make_model("tiny-moe", tmp_path / "tiny-moe", seed=0)
    public, admin, proc = start_deployment(
        "--model.name",
        str(moe),
        "--deployment.type",
        "multi_node",
        "--deployment.num_nodes",
        "2",
        "--parallel.dp",
        "2",
        "--parallel.enable_expert_parallel",
        "true",
        "--enable_return_routed_experts",
        "--deployment.ray_address",
        cluster.address,
        "--engine.kv_cache_bytes",
        str(16 << 20),
        "--engine.batch_invariant",
        "true",
        timeout=400,
    )
    try:
        rows = replicas(admin)
        assert [r["status"] for r in rows] == ["serving", "serving"]
        hf = AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32).eval()
        prompt = [11, 22, 33, 44, 55]
        choice = generate(rows[0]["url"], prompt)["choices"][0]  # served by node 0's server alone
        hf_check(moe, prompt, choice)
        trainer = patch(AutoModelForCausalLM.from_pretrained(moe, dtype=torch.float32))
        with torch.no_grad():
            trained = token_logprobs(trainer, [prompt], [choice["token_ids"]])[0]
        assert torch.equal(trained, torch.tensor(choice_lps(choice), dtype=torch.float32))
        np.testing.assert_array_equal(
            decode(choice["routed_experts"]), hf_experts(hf, (prompt + choice["token_ids"])[:-1])
        )
        for row in rows:  # one engine a node, and both exchanged tokens: node 1 stepped along with node 0
            assert httpx.get(f"{row['url']}/get_world_size", timeout=30).json() == {"world_size": 1}
            assert metric(row["url"], "rlserve:ep_all_to_alls_total") > 0
        assert generate(public, prompt)["choices"][0]["token_ids"] == choice["token_ids"]
    finally:
        stop_deployment(proc)


def test_wide_ep_push_is_kept_by_both_nodes_servers_and_replayed_after_one_is_killed(cluster, tmp_path):
    """A trainer's broadcast push into a Wide-EP deployment (one engine on each of two nodes, one expert group):
    each node's server writes its engine's part of one sharded copy, numbered by the engine's rank in the whole
    group, and the copy is indexed once both are on disk. A server SIGKILLed afterwards restarts from that
    copy and answers at the pushed version as transformers does on the pushed weights, like the other node."""
    moe = make_model("tiny-moe", tmp_path / "tiny-moe", seed=0)
    pushed = make_model("tiny-moe", tmp_path / "pushed", seed=4)
    copies = tmp_path / "copies"
    public, admin, proc = start_deployment(
        "--model.name", str(moe), "--deployment.type", "multi_node", "--deployment.num_nodes", "2",
        "--parallel.dp", "2", "--parallel.enable_expert_parallel", "true",
        "--deployment.ray_address", cluster.address, "--deployment.snapshot_dir", str(copies),
        "--weight_roots", json.dumps([str(tmp_path)]), "--engine.kv_cache_bytes", str(16 << 20),
        timeout=400,
    )  # fmt: skip
    prompt = [11, 22, 33, 44, 55]
    try:
        assert httpx.get(f"{admin}/get_world_size", timeout=30).json() == {"world_size": 2}
        version = replicas(admin)[0]["policy_version"] + 1
        trainer = TRAINER.replace('admin_api_key="admin"', "admin_api_key=None")
        assert trainer_push(admin, pushed, timeout=600, trainer=trainer) == [version]

        (copy,) = [p for p in copies.iterdir() if not p.name.startswith(".")]
        parts = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        assert sorted(os.listdir(copy)) == [*parts, INDEX_FILE] and not list(copies.glob(".*partial"))
        assert sorted(set(json.loads((copy / INDEX_FILE).read_text())["weight_map"].values())) == parts
        for part in parts:  # each node's engine wrote its own experts
            with safe_open(copy / part, "pt") as f:
                assert any(".experts." in name for name in f.keys()), part
        rows = replicas(admin)
        for row in rows:
            choice = generate(row["url"], prompt)["choices"][0]
            assert (choice["policy_version"], choice["weight_version"]) == (version, "step-7")
            hf_check(pushed, prompt, choice)

        (victim,) = [r for r in rows if r["index"] == 1]
        os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: rejoined(admin, victim), 600, "the killed server to restart from the copy")
        wait_for(lambda: all(r["status"] == "serving" for r in replicas(admin)), 600, "both servers to serve")
        for row in replicas(admin):
            choice = generate(row["url"], prompt)["choices"][0]
            assert (choice["policy_version"], choice["weight_version"]) == (version, "step-7"), row
            hf_check(pushed, prompt, choice)
        assert generate(public, prompt)["choices"][0]["policy_version"] == version
    finally:
        stop_deployment(proc)


def test_a_server_that_ray_niced_is_named_in_a_warning():
    """Ray's workers run at nice 15 unless the node's Ray was started with RAY_worker_niceness=0, and the server a
    worker starts inherits that; the supervisor warns with the fix. The test clusters here run at 0."""
    import subprocess
    import sys

    from rlserve.deploy.ray_nodes import niceness_warning

    assert niceness_warning("replica 0", 0) is None
    warning = niceness_warning("replica 1", 15)
    assert "replica 1 runs at nice 15" in warning and "RAY_worker_niceness=0" in warning
    probe = "from rlserve.deploy.ray_nodes import ReplicaHost; print(ReplicaHost.niceness(None))"
    niced = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, preexec_fn=lambda: os.nice(5)
    )
    assert int(niced.stdout) == os.getpriority(os.PRIO_PROCESS, 0) + 5  # what the server child inherits
