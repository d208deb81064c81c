"""Multi-node on Ray: one replica per node, placed by a STRICT_SPREAD placement group. Each replica has a
small actor on its node that runs `rlserve serve` as a child process (the same process tree as on one machine)
and lives as long as the deployment: a restarted server is forked from the preloaded process the actor keeps
(deploy/preloaded.py), where a new actor would import everything again. The supervisor, the router and the admin
address stay on the head node with the driver.
Disaggregated on Ray: the prefill servers' bundles come first, then the decode servers'; each server's KV block
server listens on its first node's IP, and decode servers may pull from the prefill servers' IPs.
A server spanning nodes (deployment.nodes_per_replica, or a disaggregated replica's nodes shared by its tp ranks:
DeploymentConfig.spans) takes that many bundles in a row: its HTTP server and rank 0 run on the first, its other
tensor-parallel ranks on the rest (engine/tp/ray_ranks.py)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlserve.config.schema import Config
from rlserve.deploy.preloaded import CLI
from rlserve.deploy.process import ServerChild
from rlserve.deploy.replica import ADMIN_URL_ENV, KEY_ENV, engines_per_replica, forkable, replica_config, wide_ep
from rlserve.engine.tp.ray_ranks import ActorExit
from rlserve.runtime.ports import free_port

PLACEMENT_TIMEOUT_S = 300.0
NAMESPACE = "rlserve"

log = logging.getLogger(__name__)


def niceness_warning(name: str, niceness: int) -> str | None:
    """Ray starts its workers at nice 15 (RAY_worker_niceness), and the server a worker starts inherits it: on
    a node it shares with a trainer at nice 0, the server would get the cores last. An unprivileged process
    cannot lower its niceness again, so the node's Ray has to be started without it."""
    if niceness <= 0:
        return None
    return (
        f"{name} runs at nice {niceness}, inherited from its Ray worker: processes at a lower niceness on that "
        "node (a trainer) take its cores first. Start the node's Ray with RAY_worker_niceness=0 to serve at nice 0"
    )


class ReplicaHost:
    """Ray actor on one node: starts, watches and stops the node's `rlserve serve` process, each incarnation."""

    def __init__(self) -> None:
        self.child: ServerChild | None = None
        self.workdir: str | None = None  # while a start waits for its server

    def start(self, index: int, config: dict, env: dict[str, str], fork: bool) -> str:
        ip = ray.util.get_node_ip_address()
        config = config | {"server": config["server"] | {"host": ip}}
        if "kv_transfer" in config:  # the address decode servers on other nodes pull from
            config["kv_transfer"] = config["kv_transfer"] | {"host": ip}
        # the config (it may hold API keys) lives only until the server has read it: nothing is left on the node
        self.workdir = workdir = tempfile.mkdtemp(prefix="rlserve-replica-")
        try:
            path = Path(workdir) / "replica.json"
            with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
                json.dump(config, f)
            argv = [*CLI, "serve", "@", str(path)]
            env = {**os.environ, **env}
            preloaded = fork and forkable(env)
            child = self.child = ServerChild(f"replica {index}", argv, env, preloaded=preloaded)
            return child.wait_listening(PLACEMENT_TIMEOUT_S)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            self.workdir = None

    def poll(self) -> int | None:
        return None if self.child is None else self.child.exited()

    def pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    def niceness(self) -> int:
        return os.getpriority(os.PRIO_PROCESS, 0)  # what the server inherited from this worker

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop()
            self.child = None  # a poll before the next start must not report this incarnation's exit
        if self.workdir is not None:  # a start still waiting: it cleans up too once its server has exited
            shutil.rmtree(self.workdir, ignore_errors=True)


class RayReplica:
    """The supervisor's handle on a replica in bundle `index` of the placement group."""

    def __init__(
        self,
        index: int,
        config: Config,
        key: str,
        admin_url: str,
        group,
        group_name: str,
        prefill_hosts: list[str] | None = None,
    ):
        d = config.deployment
        self.index, self.role, self.group = index, d.role(index), group
        self.bundle = d.first_bundle(index)
        self.name = f"replica {index}" if self.role is None else f"{self.role} replica {index}"
        self.config = replica_config(config, index, "0.0.0.0", prefill_hosts=prefill_hosts)
        if (span := d.span(index)) > 1:
            tp, each = config.parallel.tp, config.parallel.tp // span
            self.config.setdefault("parallel", {})["ray_ranks"] = {
                "address": ray.get_runtime_context().gcs_address,
                "namespace": NAMESPACE,
                "placement_group": group_name,
                "bundles": [self.bundle + rank // each for rank in range(tp)],
            }
        if config.num_threads is None:  # a node's replica uses that node's cores
            self.config.pop("num_threads", None)
        role_env = {"prefill": d.prefill_env_vars, "decode": d.decode_env_vars}.get(self.role or "", {})
        self.env = {**role_env, KEY_ENV: key, ADMIN_URL_ENV: admin_url}
        self.fork = d.fork_replicas
        self.pid: int | None = None  # the server's process id on its node
        self.actor = None
        self._url_ref = None
        self._exit: ActorExit | None = None

    def start(self) -> None:
        if self.actor is None:  # the first start, or the last host died (or stopped answering) with its server
            strategy = PlacementGroupSchedulingStrategy(
                placement_group=self.group, placement_group_bundle_index=self.bundle
            )
            # threaded: a poll must not queue behind `start`, which blocks until the server listens
            self.actor = (
                ray.remote(num_cpus=1, max_concurrency=4)(ReplicaHost).options(scheduling_strategy=strategy).remote()
            )
        self._url_ref = self.actor.start.remote(self.index, self.config, self.env, self.fork)
        self._exit = ActorExit(self.actor)

    def wait_listening(self, timeout_s: float) -> str:
        try:
            url = ray.get(self._url_ref, timeout=timeout_s)
        except ray.exceptions.RayTaskError as exc:  # the node's own words ("replica 1 exited ..."), not Ray's wrapping
            raise RuntimeError(str(getattr(exc, "cause", None) or exc)) from None
        self.pid = ray.get(self.actor.pid.remote(), timeout=timeout_s)
        if warning := niceness_warning(self.name, ray.get(self.actor.niceness.remote(), timeout=timeout_s)):
            log.warning(warning)
        return url

    def exited(self) -> int | None:
        """Never blocks (the supervisor's event loop calls it; see ActorExit)."""
        return None if self._exit is None else self._exit()

    def stop(self) -> None:
        """Stop the server; its host stays for the next start unless it is gone or does not answer."""
        if self.actor is None:
            return
        try:
            ray.get(self.actor.stop.remote(), timeout=60)
            return
        except (ray.exceptions.RayError, ray.exceptions.GetTimeoutError):
            self.close()

    def close(self) -> None:
        """End the host with whatever it still runs (its server dies with it)."""
        if self.actor is not None:
            ray.kill(self.actor)
            self.actor, self._exit = None, None


def ray_replicas(config: Config, key: str, admin_url: str) -> list[RayReplica]:
    """Join the running cluster and reserve one CPU on each of deployment.nodes distinct nodes."""
    d = config.deployment
    ray.init(address=d.ray_address, namespace=NAMESPACE, log_to_driver=True)
    name = f"rlserve-{uuid.uuid4().hex}"  # spanning replicas' ranks find their bundles by it
    group = placement_group([{"CPU": 1}] * d.nodes, strategy="STRICT_SPREAD", name=name)
    try:
        ray.get(group.ready(), timeout=PLACEMENT_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        if d.type == "disaggregated":
            what, lower = (
                f"{d.prefill_servers} prefill + {d.decode_servers} decode servers",
                "deployment.num_prefill_nodes / num_decode_nodes",
            )
        else:
            what, lower = f"{d.size} replicas", "deployment.num_nodes (or copies)"
        raise RuntimeError(
            f"Ray could not place {what} on {d.nodes} distinct nodes with a free CPU each: add nodes "
            f"(ray start --address ...) or lower {lower}"
        ) from None
    prefill_hosts = None
    if d.type == "disaggregated":
        ips = _bundle_ips(group)
        prefill_hosts = sorted({ips[d.first_bundle(i)] for i in range(d.size) if d.role(i) == "prefill"})
    replicas = [RayReplica(i, config, key, admin_url, group, name, prefill_hosts) for i in range(d.size)]
    if wide_ep(config):
        _join_expert_groups(config, replicas, _bundle_ips(group))
    return replicas


def _join_expert_groups(config: Config, replicas: list[RayReplica], ips: dict[int, str]) -> None:
    """Wide-EP: each copy's servers are one expert group, rank 0 of its first server hosting the rendezvous
    (parallel.data_parallel_rpc_port, or a port free here: pin it where the nodes' free ports differ)."""
    d, p = config.deployment, config.parallel
    local = engines_per_replica(config)
    ports: dict[int, int] = {}
    for replica in replicas:
        copy, position = d.copy_of(replica.index), replica.index % d.copy_size
        port = ports.setdefault(copy, p.data_parallel_rpc_port or free_port("127.0.0.1"))
        replica.config.setdefault("parallel", {}).update(
            dp=local,
            data_parallel_size=p.dp,
            data_parallel_start_rank=position * local,
            data_parallel_rank=position * local,
            data_parallel_address=ips[d.first_bundle(copy * d.copy_size)],
            data_parallel_rpc_port=port,
        )


def new_rendezvous(config: Config, replicas: list[RayReplica]) -> None:
    """A Wide-EP group restarting as a whole meets on a fresh port (the old one's store may still be held by a
    member on its way out), unless parallel.data_parallel_rpc_port pins it."""
    if config.parallel.data_parallel_rpc_port is None:
        port = free_port("127.0.0.1")
        for replica in replicas:
            replica.config["parallel"]["data_parallel_rpc_port"] = port


def _bundle_ips(group) -> dict[int, str]:
    """Bundle index -> the IP of the node Ray placed it on."""
    nodes = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
    placed = ray.util.placement_group_table(group)["bundles_to_node_id"]
    return {int(i): nodes[node] for i, node in placed.items()}


def release(replicas: list) -> None:
    """After the replicas stopped: end their hosts, give the placement group back and leave the cluster."""
    ours = [r for r in replicas if isinstance(r, RayReplica)]
    for replica in ours:
        replica.close()
    groups = {id(r.group): r.group for r in ours}
    for group in groups.values():
        remove_placement_group(group)
    if groups and ray.is_initialized():
        ray.shutdown()
