"""The [deployment] section: how many engine servers, where they run, and the vllm-router in front of
them (deploy/ builds it from this)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, PrivateAttr

from rlserve.config.section import Section


class RouterConfig(Section):
    type: Literal["vllm-router"] = Field("vllm-router", description="the router in front of several replicas")
    policy: Literal["consistent_hash", "round_robin", "power_of_two", "cache_aware"] = Field(
        "consistent_hash", description="consistent_hash keeps an X-Session-ID on one replica"
    )
    extra_args: list[str] = Field(default_factory=list, description="more vllm-router arguments, passed as given")
    allow_open_worker_routes: bool = Field(
        False,
        description="run the router on a non-loopback server.host although its worker routes "
        "(/add_worker, /remove_worker) take no key (behind a firewall that admits only your clients)",
    )


class HealthCheckConfig(Section):
    """The supervisor's probes of every replica's /health (deploy/liveness.py); vllm-router's own
    --health-check-* flags mean the same for its checks, which rlserve leaves at their defaults."""

    interval_s: float = Field(1.0, gt=0, description="between two probes of a replica")
    timeout_s: float = Field(
        10.0, gt=0, description="a probe unanswered by then fails (generous: a loaded machine can slow a healthy one)"
    )
    failure_threshold: int = Field(
        3,
        ge=1,
        description="failed probes in a row that take a replica out of the router's rotation (under Wide-EP: that "
        "restart its expert group)",
    )
    readmit_timeout_s: float = Field(
        30.0,
        gt=0,
        description="for a replica that answers again to take the deployment's pause state (its engine answering "
        "too); past it the replica is restarted",
    )


class DeploymentConfig(Section):
    type: Literal["single_node", "multi_node", "disaggregated"] = Field(
        "single_node",
        description="single_node: replicas on this machine; multi_node: one replica per Ray node; "
        "disaggregated: prefill and decode replicas behind vllm-router's P/D mode, KV moved between them",
    )
    replicas: int = Field(1, ge=1, description="engine servers on this machine (single_node); 1 = no router")
    copies: int = Field(
        1,
        ge=1,
        description="independent copies of this deployment, each behind its own vllm-router (prime-rl's "
        "num_infer_replicas): copy 0's router on server.port, copy c's on server.port + 1 + c (free ports when "
        "server.port is 0); one admin address reaches the replicas of every copy",
    )
    num_nodes: int = Field(1, ge=1, description="multi_node: Ray nodes, one replica each (see nodes_per_replica)")
    nodes_per_replica: int = Field(
        1,
        ge=1,
        description="multi_node: each replica spans this many Ray nodes, its parallel.tp ranks split evenly over "
        "them (one HTTP server on the first; the ranks talk over torch.distributed); num_nodes / this = replicas",
    )
    backend_port: int | None = Field(
        None, ge=0, le=65535, description="first replica port (replica i: +i); none = free ports"
    )
    admin_port: int | None = Field(
        None, ge=0, le=65535, description="admin fan-out address of every replica; none = server.port + 1"
    )
    ray_address: str = Field("auto", description="multi_node, disaggregated on Ray: the Ray cluster to join")
    router: RouterConfig = Field(default_factory=RouterConfig)
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    num_prefill_replicas: int = Field(
        1, ge=1, description="disaggregated: prefill replicas (on Ray, each on num_prefill_nodes nodes)"
    )
    num_decode_replicas: int = Field(
        1, ge=1, description="disaggregated: decode replicas (on Ray, each on num_decode_nodes nodes)"
    )
    num_prefill_nodes: int | None = Field(
        None,
        ge=1,
        description="disaggregated on Ray: Ray nodes under each prefill replica (prime-rl's meaning; "
        "num_prefill_replicas x this nodes in all). A replica's parallel.tp ranks spread over its nodes, one "
        "server per gcd(tp, nodes) nodes: tp = 1 runs a server on each node, tp = nodes one server spanning "
        "them all. Setting it (or num_decode_nodes) places the servers on the cluster at ray_address",
    )
    num_decode_nodes: int | None = Field(
        None, ge=1, description="disaggregated on Ray: Ray nodes under each decode replica (default 1 on Ray)"
    )
    prefill_env_vars: dict[str, str] = Field(
        default_factory=dict, description="disaggregated: extra environment of every prefill server"
    )
    decode_env_vars: dict[str, str] = Field(
        default_factory=dict, description="disaggregated: extra environment of every decode server"
    )
    non_cached_tokens: int = Field(
        0,
        ge=0,
        description="disaggregated: a request with fewer prompt tokens missing from the decode server's "
        "prefix cache is prefilled there instead of pulling KV (kv_transfer.non_cached_tokens)",
    )
    snapshot_dir: str | None = Field(None, description="where pushed weights are kept for restarts and undo")
    bind_cores: bool = Field(
        True,
        description="replicas on this machine: give each its own CPU cores (sched_setaffinity, inherited by its "
        "threads and engine processes) when their threads fit the cores this process may use; false = the OS "
        "places them. Unbound, the scheduler puts a KV pull's sender and receiver on one core",
    )
    fork_replicas: bool = Field(
        True,
        description="fork each start and restart of a replica from one process (on its node, on Ray) that "
        "imported the server stack once (~6 s of CPU less each, on Linux) where the replica's environment is its "
        "launcher's; false = exec each afresh",
    )

    # parallel.tp, set by Config: how many nodes a disaggregated server on Ray spans depends on it
    _tp: int = PrivateAttr(1)

    @property
    def on_ray(self) -> bool:
        """multi_node, or disaggregated with num_prefill_nodes / num_decode_nodes."""
        return self.type == "multi_node" or (
            self.type == "disaggregated" and (self.num_prefill_nodes, self.num_decode_nodes) != (None, None)
        )

    def _role_spans(self, role: str) -> list[int]:
        """Ray nodes under each of a role's servers in one copy (1 each off Ray)."""
        replicas = getattr(self, f"num_{role}_replicas")
        if not self.on_ray:
            return [1] * replicas
        nodes = getattr(self, f"num_{role}_nodes") or 1
        span = math.gcd(self._tp, nodes)
        return [span] * (replicas * nodes // span)

    @property
    def prefill_servers(self) -> int:
        return len(self._role_spans("prefill")) if self.type == "disaggregated" else 0

    @property
    def decode_servers(self) -> int:
        return len(self._role_spans("decode")) if self.type == "disaggregated" else 0

    @property
    def spans(self) -> list[int]:
        """Ray nodes under each engine server of one copy, in server order (one bundle each)."""
        if self.type == "disaggregated":
            return self._role_spans("prefill") + self._role_spans("decode")
        if self.type == "multi_node":
            return [self.nodes_per_replica] * (self.num_nodes // self.nodes_per_replica)
        return [1] * self.replicas

    @property
    def copy_size(self) -> int:
        """Engine servers in one copy."""
        return len(self.spans)

    def span(self, index: int) -> int:
        """Ray nodes under server `index`."""
        return self.spans[index % self.copy_size]

    def first_bundle(self, index: int) -> int:
        """The placement-group bundle of server `index`'s first node; its next span(index) - 1 hold its other
        ranks."""
        copy, position = divmod(index, self.copy_size)
        return copy * sum(self.spans) + sum(self.spans[:position])

    @property
    def nodes(self) -> int:
        """Ray nodes the whole deployment takes (all copies)."""
        return sum(self.spans) * self.copies

    @property
    def size(self) -> int:
        """Engine servers in all copies; replica `index` belongs to copy index // copy_size."""
        return self.copy_size * self.copies

    def copy_of(self, index: int) -> int:
        return index // self.copy_size

    def role(self, index: int) -> str | None:
        """disaggregated: replica `index` is "prefill" (its copy's first prefill_servers) or "decode"."""
        if self.type != "disaggregated":
            return None
        return "prefill" if index % self.copy_size < self.prefill_servers else "decode"

    def router_port(self, copy: int, server_port: int) -> int:
        """Where copy `copy`'s router listens (0: a free port)."""
        if copy == 0 or not server_port:
            return server_port
        return server_port + 1 + copy

    @property
    def enabled(self) -> bool:
        return self.type != "single_node" or self.replicas > 1 or self.copies > 1
