"""prime-rl's disaggregated block with replicas that span nodes (fixtures/prime_rl_docs/07_pd_replicas.toml: 2
prefill replicas of 2 nodes each, 1 decode replica of 2 nodes), run as written plus parallel.tp = 2 on a local
six-node Ray cluster: three servers, each with one tensor-parallel rank on each of its two nodes. Through the
real vllm-router their answers and router replay's routed experts equal one local tp=2 server's, the decode
server pulls every full block, it restarts on its two nodes when it dies, and SIGTERM ends every process on
every node. The docs blocks 06 and 07 as written (tp = 1) run a server on each of their nodes."""

from __future__ import annotations

import os
import signal
import warnings
from pathlib import Path

import httpx
import numpy as np
import pytest

from conftest import start_server, stop_server
from deploy_helpers import (
    descendants,
    local_ray_cluster,
    replicas,
    sigterm_leaves_nothing,
    start_deployment,
    stop_deployment,
    wait_for,
)
from rlserve.model.make import make_model
from test_deploy_ray import _raylet_above, _raylets, _tp_workers
from test_pd import BLOCK, close, metric, prompts
from test_pd_replay import experts, generate

pytest.importorskip("ray")

DOCS_BLOCK = Path(__file__).parent / "fixtures" / "prime_rl_docs" / "07_pd_replicas.toml"


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster(num_nodes=6) as c:
        yield c


def _same_as_single(public: str, single: str, seed: int, lengths: list[int]) -> None:
    for prompt in prompts(seed, lengths):
        generate(single, prompt, max_tokens=1)  # the state D answers in (test_pd.warm)
        got, want = generate(public, prompt), generate(single, prompt)
        assert got["token_ids"] == want["token_ids"]
        assert close(*([c["logprob"] for c in x["logprobs"]["content"]] for x in (got, want)))
        np.testing.assert_array_equal(experts(got["routed_experts"]), experts(want["routed_experts"]))


def _decode_restarted(admin: str) -> list[dict] | None:
    """The rows once the decode server serves again and every server serves. A loaded machine may take the decode
    server more than one try to start (the supervisor retries), so its count is at least 1; a prefill server that
    stopped answering meanwhile may have been restarted too (the test reports that as a warning)."""
    rows = sorted(replicas(admin), key=lambda r: r["index"])
    done = rows[2]["restarts"] >= 1 and all(r["status"] == "serving" for r in rows)
    return rows if done else None


def _tree(proc, admin: str, rows: list[dict]) -> list[int]:
    """The deployment's processes on this machine, its router and its servers on the Ray nodes."""
    router = httpx.get(f"{admin}/deployment", timeout=30).json()["router_pid"]
    return [*descendants(proc.pid), router, *(r["pid"] for r in rows)]


def _replaced(cluster, before: list[int], count: int) -> list[int] | None:
    now = _tp_workers(cluster)
    return now if len(set(now) - set(before)) == count else None


def test_docs_pd_replicas_of_two_nodes_each_serve_as_one_server_and_stop_whole(cluster, tmp_path):
    moe_dir = make_model("tiny-moe", tmp_path / "moe", seed=0)
    # one torch thread per rank everywhere: reductions split over threads round differently
    common = ("--model.name", str(moe_dir), "--parallel.tp", "2", "--num_threads", "1")
    common += ("--enable_return_routed_experts", "--engine.kv_cache_bytes", str(16 << 20))
    url, single = start_server(*common)
    try:
        public, admin, proc = start_deployment(
            "@", str(DOCS_BLOCK), *common, "--deployment.ray_address", cluster.address, timeout=600
        )
        try:
            rows = sorted(replicas(admin), key=lambda r: r["index"])
            assert [(r["role"], r["status"]) for r in rows] == [("prefill", "serving")] * 2 + [("decode", "serving")]
            # six processes, one on each node: every server's rank 0 and its remote rank 1
            raylets = _raylets(cluster)
            workers = _tp_workers(cluster)
            nodes = {_raylet_above(pid, raylets) for pid in [*(r["pid"] for r in rows), *workers]}
            assert len(workers) == 3 and None not in nodes and len(nodes) == 6
            d = rows[2]["url"]
            lengths = [40, 75, 130]
            _same_as_single(public, url, 41, lengths)
            assert metric(d, "rlserve:kv_transfer_tokens_total") == sum((n - 1) // BLOCK * BLOCK for n in lengths)
            assert metric(d, "rlserve:kv_transfer_local_fallbacks_total") == 0
            # the decode server dies: it restarts on its two nodes, and its old remote rank is gone with it
            os.kill(rows[2]["pid"], signal.SIGKILL)
            rows = wait_for(
                lambda: _decode_restarted(admin), 400, "the decode server to restart whole", lambda: replicas(admin)
            )
            if [r["restarts"] for r in rows] != [0, 0, 1]:
                warnings.warn(f"more restarts than the decode server's one: {rows}", stacklevel=1)
            _same_as_single(public, url, 42, [60])
            assert metric(rows[2]["url"], "rlserve:kv_transfer_local_fallbacks_total") == 0
            restarted = sum(r["restarts"] > 0 for r in rows)  # each restarted server has a new remote rank
            replaced = wait_for(
                lambda: _replaced(cluster, workers, restarted), 120, "the restarted servers' remote ranks"
            )
            assert len(replaced) == 3 and len(set(workers) - set(replaced)) == restarted
            tree = [*_tree(proc, admin, rows), *_tp_workers(cluster)]
        except BaseException:
            stop_deployment(proc)
            raise
    finally:
        stop_server(single)
    sigterm_leaves_nothing(proc, tree, 120, "every server and remote rank on the six nodes to exit")


@pytest.mark.parametrize(
    "block, roles",
    [("06_pd.toml", ["prefill"] * 2 + ["decode"] * 2), ("07_pd_replicas.toml", ["prefill"] * 4 + ["decode"] * 2)],
)
def test_docs_pd_blocks_as_written_run_a_server_on_each_node(cluster, block, roles):
    """At tp = 1 (the blocks as written) every node of a replica runs a server of its own: 06 takes 4 nodes, 07
    all 6 (2 prefill replicas of 2 nodes, 1 decode replica of 2). Both serve through the router and stop whole."""
    public, admin, proc = start_deployment(
        "@",
        str(DOCS_BLOCK.parent / block),
        "--num_threads",
        "1",
        "--engine.kv_cache_bytes",
        str(16 << 20),
        "--deployment.ray_address",
        cluster.address,
        timeout=600,
    )
    try:
        rows = sorted(replicas(admin), key=lambda r: r["index"])
        assert [r["role"] for r in rows] == roles and all(r["status"] == "serving" for r in rows)
        raylets = _raylets(cluster)
        assert len({_raylet_above(r["pid"], raylets) for r in rows} - {None}) == len(roles)
        (prompt,) = prompts(43, [70])
        got = generate(public, prompt)
        assert len(got["token_ids"]) > 0
        assert sum(metric(r["url"], "rlserve:kv_transfer_tokens_total") for r in rows if r["role"] == "decode") > 0
        tree = _tree(proc, admin, rows)
    except BaseException:
        stop_deployment(proc)
        raise
    sigterm_leaves_nothing(proc, tree, 120, "every server on the cluster's nodes and the router to exit")
