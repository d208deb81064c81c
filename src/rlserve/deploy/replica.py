"""One replica = one `rlserve serve` process tree, started from the deployment's config with its own
port, its share of the machine, and the internal key that lets only the deployment admin it."""

from __future__ import annotations

import json
import os
from pathlib import Path

from rlserve.config.schema import Config, KVTransferConfig
from rlserve.deploy.preloaded import can_fork
from rlserve.deploy.process import CLI, ServerChild

# what the supervisor hands a replica (server/fleet/deployment_guard.py reads them)
KEY_ENV = "RLSERVE_DEPLOYMENT_KEY"
ADMIN_URL_ENV = "RLSERVE_DEPLOYMENT_ADMIN_URL"


def forkable(env: dict[str, str]) -> bool:
    """Whether a replica with `env` may fork from the preloaded process: the deployment's key and admin address
    are read as the server runs; any other difference from that process's environment (a role's env vars, a
    GPU's CUDA_VISIBLE_DEVICES) execs the replica."""
    return can_fork(env, read_at_run_time=(KEY_ENV, ADMIN_URL_ENV))


def replica_config(
    config: Config, index: int, host: str, cpu_count: int | None = None, prefill_hosts: list[str] | None = None
) -> dict:
    """The deployment's config as one plain server: its own port, one replica, its share of threads;
    in a disaggregated deployment also a KV block server (prefill) or puller (decode) that may pull from
    `prefill_hosts` (default: `host`, where the prefill replicas of one machine listen)."""
    d = config.deployment
    data = config.model_dump(mode="json", exclude_defaults=True)
    data.pop("deployment", None)
    server = data.setdefault("server", {})
    server["host"] = host
    server["port"] = d.backend_port + index if d.backend_port else 0
    if d.role(index) is not None:
        transfer = data.setdefault("kv_transfer", {})
        transfer.setdefault("host", host)
        if d.role(index) == "decode":
            peers = prefill_hosts if prefill_hosts is not None else [host]
            transfer["peer_hosts"] = sorted({*peers, *transfer.get("peer_hosts", KVTransferConfig().peer_hosts)})
        transfer["non_cached_tokens"] = d.non_cached_tokens
    if config.num_threads is None:
        data["num_threads"] = replica_threads(config, cpu_count)
    if d.snapshot_dir is not None:  # the deployment's copies of pushed weights: a replica must be able to load them
        data["weight_roots"] = [*config.weight_roots, d.snapshot_dir]
    return data


def wide_ep(config: Config) -> bool:
    """multi_node with expert parallelism (prime-rl's Wide-EP): the replicas of a copy, one per node, form one
    expert group, each running parallel.dp / replicas of its data-parallel engines."""
    d, p = config.deployment, config.parallel
    return d.type == "multi_node" and p.enable_expert_parallel and d.nodes_per_replica == 1 and d.copy_size > 1


def engines_per_replica(config: Config) -> int:
    """Data-parallel engines behind each replica's one API server."""
    return config.parallel.dp // config.deployment.copy_size if wide_ep(config) else config.parallel.dp


def replica_threads(config: Config, cpu_count: int | None = None) -> int:
    """Torch threads per engine rank of each replica: the configured ones, or an even share of the cores."""
    return config.num_threads or max(1, (cpu_count or len(usable_cores())) // config.deployment.size)


def usable_cores() -> list[int]:
    """The cores this process may run on (a taskset or cpuset narrows them), or all of them where the OS can't say."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def replica_cores(config: Config, allowed: list[int] | None = None) -> list[list[int] | None]:
    """Disjoint cores for each local replica, in index order, each as many as its threads (torch threads per
    engine rank times ranks); all None when binding is off, unsupported, or the threads do not fit `allowed`."""
    d = config.deployment
    allowed = usable_cores() if allowed is None else allowed
    each = replica_threads(config, len(allowed)) * config.parallel.tp * config.parallel.dp
    if not d.bind_cores or not hasattr(os, "sched_setaffinity") or each * d.size > len(allowed):
        return [None] * d.size
    return [allowed[i * each : (i + 1) * each] for i in range(d.size)]


class LocalReplica:
    """A replica on this machine, restartable: each start() is a new process (a new incarnation)."""

    def __init__(
        self,
        index: int,
        config: Config,
        workdir: Path,
        key: str,
        admin_url: str,
        gpu: bool = False,
        cores: list[int] | None = None,
    ):
        d = config.deployment
        self.index, self.role, self.cores = index, d.role(index), cores
        self.name = f"replica {index}" if self.role is None else f"{self.role} replica {index}"
        self.config_path = workdir / f"replica-{index}.json"
        fd = os.open(self.config_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # may hold API keys
        with os.fdopen(fd, "w") as f:
            json.dump(replica_config(config, index, "127.0.0.1"), f)
        role_env = {"prefill": d.prefill_env_vars, "decode": d.decode_env_vars}.get(self.role or "", {})
        self.env = {**os.environ, **role_env, KEY_ENV: key, ADMIN_URL_ENV: admin_url}
        if gpu:  # the i-th GPU this process may use
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            self.env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index].strip() if visible else str(index)
        self.fork = d.fork_replicas
        self.child: ServerChild | None = None

    def start(self) -> None:
        preloaded = self.fork and forkable(self.env)
        argv = [*CLI, "serve", "@", str(self.config_path)]
        self.child = ServerChild(self.name, argv, self.env, cores=self.cores, preloaded=preloaded)

    def wait_listening(self, timeout_s: float) -> str:
        assert self.child is not None
        return self.child.wait_listening(timeout_s)

    def exited(self) -> int | None:
        return None if self.child is None else self.child.exited()

    @property
    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
