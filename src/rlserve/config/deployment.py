"""The [deployment] section: how many engine servers, where they run, and the vllm-router in front of
them (deploy/ builds it from this)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

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
    num_prefill_replicas: int = Field(1, ge=1, description="disaggregated: prefill servers on this machine")
    num_decode_replicas: int = Field(1, ge=1, description="disaggregated: decode servers on this machine")
    num_prefill_nodes: int | None = Field(
        None,
        ge=1,
        description="disaggregated on Ray: Ray nodes with one prefill server each; setting it (or "
        "num_decode_nodes) places the servers on the cluster at ray_address instead of this machine",
    )
    num_decode_nodes: int | None = Field(
        None, ge=1, description="disaggregated on Ray: Ray nodes with one decode server each (default 1 on Ray)"
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

    @property
    def on_ray(self) -> bool:
        """multi_node, or disaggregated with num_prefill_nodes / num_decode_nodes: one server per Ray node."""
        return self.type == "multi_node" or (
            self.type == "disaggregated" and (self.num_prefill_nodes, self.num_decode_nodes) != (None, None)
        )

    @property
    def prefill_servers(self) -> int:
        if self.type != "disaggregated":
            return 0
        return (self.num_prefill_nodes or 1) if self.on_ray else self.num_prefill_replicas

    @property
    def decode_servers(self) -> int:
        if self.type != "disaggregated":
            return 0
        return (self.num_decode_nodes or 1) if self.on_ray else self.num_decode_replicas

    @property
    def copy_size(self) -> int:
        """Engine servers in one copy."""
        if self.type == "disaggregated":
            return self.prefill_servers + self.decode_servers
        return self.num_nodes // self.nodes_per_replica if self.type == "multi_node" else self.replicas

    @property
    def span(self) -> int:
        """Ray nodes under each server (one bundle each, in server order)."""
        return self.nodes_per_replica if self.type == "multi_node" else 1

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
