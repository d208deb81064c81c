"""`[deployment]`: shapes, defaults, and the combinations rejected when the config loads."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from rlserve.config.load import ConfigError, load_config
from rlserve.deploy.replica import replica_config, replica_cores
from rlserve.deploy.router import router_argv


def test_defaults_are_one_plain_server():
    d = load_config([]).deployment
    assert (d.type, d.replicas, d.enabled, d.router.policy) == ("single_node", 1, False, "consistent_hash")


def test_toml_section(tmp_path):
    path = tmp_path / "deploy.toml"
    path.write_text(
        "[server]\nport = 8100\n[deployment]\nreplicas = 2\nbackend_port = 8200\n"
        '[deployment.router]\npolicy = "power_of_two"\nextra_args = ["--disable-retries"]\n'
        "[deployment.health_check]\ntimeout_s = 3\n"
    )
    config = load_config(["@", str(path)])
    assert config.deployment.enabled and config.deployment.router.policy == "power_of_two"
    probes = config.deployment.health_check
    assert (probes.interval_s, probes.timeout_s, probes.failure_threshold, probes.readmit_timeout_s) == (1, 3, 3, 30)
    argv = router_argv(config, "127.0.0.1", 8100, ["http://127.0.0.1:8200", "http://127.0.0.1:8201"], 29100)
    # the launch contract of docs/protocols.md §1.1, then the pass-through arguments
    for flag, value in [
        ("--policy", "power_of_two"),
        ("--port", "8100"),
        ("--request-id-headers", "x-session-id"),
        ("--worker-startup-timeout-secs", "4200"),
        ("--prometheus-port", "29100"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert argv[argv.index("--worker-urls") + 1 :][:2] == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]
    assert argv[-1] == "--disable-retries"


@pytest.mark.parametrize(
    "args, message",
    [
        (
            [
                "--deployment.type",
                "disaggregated",
                "--deployment.num_prefill_nodes",
                "2",
                "--parallel.tp",
                "2",
                "--parallel.dp",
                "2",
            ],
            "data-parallel engines do not span nodes: set parallel.dp = 1",
        ),
        (["--deployment.num_decode_nodes", "2"], "deployment.type = 'disaggregated'"),
        (["--deployment.type", "disaggregated", "--deployment.replicas", "2"], "num_prefill_replicas"),
        (["--deployment.non_cached_tokens", "64"], "deployment.type = 'disaggregated'"),
        (["--deployment.num_nodes", "2"], "deployment.type = 'multi_node'"),
        (["--deployment.type", "multi_node", "--deployment.replicas", "2"], "deployment.num_nodes"),
        (["--deployment.replicas", "2", "--server.port", "8000", "--deployment.admin_port", "8000"], "admin_port"),
        (
            ["--deployment.replicas", "2", "--server.port", "8000", "--deployment.backend_port", "8001"],
            "overlaps port 8001",
        ),
        (["--deployment.replicas", "2", "--model.device", "cuda:1"], "model.device = 'cuda'"),
        (["--deployment.router.policy", "random"], "deployment.router.policy"),
        (["--deployment.health_check.failure_threshold", "0"], "deployment.health_check.failure_threshold"),
        (["--deployment.nodes_per_replica", "2"], "deployment.type = 'multi_node'"),
        (
            ["--deployment.type", "multi_node", "--deployment.num_nodes", "2", "--deployment.nodes_per_replica", "2"],
            "and parallel.tp (1: every node runs the same number",
        ),
        (
            ["--deployment.type", "multi_node", "--deployment.num_nodes", "3", "--deployment.nodes_per_replica", "2"],
            "must divide",
        ),
        (
            [
                "--deployment.type",
                "multi_node",
                "--deployment.num_nodes",
                "2",
                "--parallel.enable_expert_parallel",
                "true",
            ],
            "set parallel.dp to a multiple of 2",
        ),
        (["--parallel.data_parallel_size", "2"], "set enable_expert_parallel"),
        (
            [
                "--parallel.enable_expert_parallel",
                "true",
                "--parallel.data_parallel_size",
                "2",
                "--parallel.dp",
                "2",
                "--parallel.data_parallel_start_rank",
                "1",
            ],
            "must lie inside it",
        ),
    ],
)
def test_impossible_combinations_say_what_to_change(args, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(args)


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="ray is installed here")
def test_multi_node_needs_ray():
    with pytest.raises(ConfigError, match=r"rlserve\[ray\]"):
        load_config(["--deployment.type", "multi_node", "--deployment.num_nodes", "2"])


def test_each_replica_gets_its_port_and_share_of_threads():
    config = load_config(
        [
            "--deployment.replicas",
            "2",
            "--deployment.backend_port",
            "9100",
            "--server.port",
            "9000",
            "--server.admin_api_key",
            "k",
        ]
    )
    first, second = (replica_config(config, i, "127.0.0.1", cpu_count=8) for i in range(2))
    assert (first["server"]["port"], second["server"]["port"]) == (9100, 9101)
    assert first["num_threads"] == second["num_threads"] == 4
    assert "deployment" not in first and first["server"]["admin_api_key"] == "k"
    pinned = load_config(["--deployment.replicas", "2", "--num_threads", "3"])
    assert replica_config(pinned, 0, "127.0.0.1", cpu_count=8)["num_threads"] == 3
    # a replica's config is a plain server's config
    assert not load_config(["--server.port", str(first["server"]["port"])]).deployment.enabled


@pytest.mark.parametrize(
    "args, cores",
    [
        (["--deployment.type", "disaggregated"], [[0, 1, 2, 3], [4, 5, 6, 7]]),  # threads unset: an even split
        (["--deployment.replicas", "3", "--num_threads", "2"], [[0, 1], [2, 3], [4, 5]]),
        (["--deployment.replicas", "2", "--num_threads", "2", "--parallel.tp", "2"], [[0, 1, 2, 3], [4, 5, 6, 7]]),
        (["--deployment.replicas", "3", "--num_threads", "3"], [None] * 3),  # 9 threads on 8 cores: the OS places them
        (["--deployment.type", "disaggregated", "--deployment.bind_cores", "false"], [None] * 2),
    ],
)
def test_local_replicas_get_disjoint_cores_when_their_threads_fit(args, cores):
    assert replica_cores(load_config(args), allowed=list(range(8))) == cores


def test_disaggregated_on_ray_places_one_server_per_node_and_decode_pulls_from_the_prefill_nodes():
    config = load_config(
        [
            "--deployment.type",
            "disaggregated",
            "--deployment.num_prefill_nodes",
            "2",
            "--deployment.num_decode_nodes",
            "3",
            "--deployment.non_cached_tokens",
            "64",
        ]
    )
    d = config.deployment
    assert d.on_ray and d.size == 5 and [d.role(i) for i in range(5)] == ["prefill"] * 2 + ["decode"] * 3
    decode = replica_config(config, 4, "0.0.0.0", prefill_hosts=["10.0.0.1", "10.0.0.2"])
    assert {"10.0.0.1", "10.0.0.2"} <= set(decode["kv_transfer"]["peer_hosts"])
    assert decode["kv_transfer"]["non_cached_tokens"] == 64
    # one side given: the other is one node; on this machine the replica counts rule
    assert (
        load_config(["--deployment.type", "disaggregated", "--deployment.num_decode_nodes", "2"]).deployment.size == 3
    )
    local = load_config(["--deployment.type", "disaggregated", "--deployment.num_decode_replicas", "2"]).deployment
    assert not local.on_ray and local.size == 3


@pytest.mark.parametrize(
    "tp, spans",
    [
        (1, [1, 1, 1, 1, 1, 1]),  # every node a server of its own (data parallel over a replica's nodes)
        (2, [2, 2, 2]),  # each replica one server, its two ranks on two nodes
        (4, [2, 2, 2]),  # two ranks on each node
    ],
)
def test_prime_rl_disaggregated_replicas_span_their_nodes_on_ray(tp, spans):
    """The docs' block: 2 prefill replicas of 2 nodes each and 1 decode replica of 2 nodes, 6 nodes in all."""
    docs = Path(__file__).parent / "fixtures" / "prime_rl_docs" / "07_pd_replicas.toml"
    d = load_config(["@", str(docs), "--parallel.tp", str(tp)]).deployment
    assert d.on_ray and d.spans == spans and d.nodes == 6
    servers = len(spans)
    assert [d.role(i) for i in range(servers)] == ["prefill"] * (servers * 2 // 3) + ["decode"] * (servers // 3)
    assert [d.first_bundle(i) for i in range(servers)] == [sum(spans[:i]) for i in range(servers)]
    twice = load_config(["@", str(docs), "--parallel.tp", str(tp), "--deployment.copies", "2"]).deployment
    assert twice.nodes == 12 and twice.first_bundle(servers) == 6 and twice.role(servers) == "prefill"


@pytest.mark.parametrize(
    "host, opt_in, ok",
    [
        ("127.0.0.1", False, True),
        ("localhost", False, True),
        ("::1", False, True),
        ("0.0.0.0", False, False),
        ("::", False, False),
        ("0.0.0.0", True, True),
    ],
)
def test_the_router_opens_to_the_network_only_by_explicit_opt_in(host, opt_in, ok):
    """vllm-router takes no key on /add_worker and /remove_worker: off loopback they would be anyone's."""
    from rlserve.deploy.run import check_router_exposure

    config = load_config(
        [
            "--deployment.replicas",
            "2",
            "--server.host",
            host,
            "--server.admin_api_key",
            "k",
            "--deployment.router.allow_open_worker_routes",
            str(opt_in).lower(),
        ]
    )
    if ok:
        check_router_exposure(config)
    else:
        with pytest.raises(SystemExit, match="allow_open_worker_routes true"):
            check_router_exposure(config)


def test_a_deployment_on_an_open_host_refuses_before_starting_anything():
    import subprocess
    import sys

    from conftest import SERVER_DEFAULTS

    proc = subprocess.run(  # the check runs before any replica or router starts: nothing is served on 0.0.0.0
        [
            sys.executable,
            "-m",
            "rlserve.cli",
            "serve",
            "--deployment.replicas",
            "2",
            "--server.host",
            "0.0.0.0",
            "--server.port",
            "0",
            "--server.admin_api_key",
            "k",
            *SERVER_DEFAULTS,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode != 0
    assert "/add_worker" in proc.stderr and "--deployment.router.allow_open_worker_routes true" in proc.stderr
    assert "rlserve: serving" not in proc.stdout + proc.stderr and "[replica" not in proc.stdout + proc.stderr


def test_admin_address_opens_to_the_network_only_behind_a_key():
    from rlserve.deploy.run import _admin_host

    assert _admin_host(load_config(["--deployment.replicas", "2", "--server.host", "0.0.0.0"])) == "127.0.0.1"
    keyed = load_config(["--deployment.replicas", "2", "--server.host", "0.0.0.0", "--server.admin_api_key", "k"])
    assert _admin_host(keyed) == "0.0.0.0"
