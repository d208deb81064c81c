"""Config combinations that cannot work, across sections, rejected whenever a Config is built (messages say
what to change). The sections' own field checks stay beside their fields in schema.py."""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlserve.config.schema import Config


def check_combinations(config: Config) -> None:
    if config.model.max_model_len is not None and config.engine.max_num_batched_tokens < config.engine.block_size:
        raise ValueError("engine.max_num_batched_tokens must be at least engine.block_size")
    p = config.parallel
    if p.enable_eplb and not p.enable_expert_parallel:
        raise ValueError("enable_eplb balances experts over expert-parallel ranks: set enable_expert_parallel = true")
    if p.data_parallel_size is not None:
        if not p.enable_expert_parallel:
            raise ValueError(
                "parallel.data_parallel_size joins servers in one expert group: set enable_expert_parallel"
            )
        if p.data_parallel_start_rank + p.dp > p.data_parallel_size or p.data_parallel_rpc_port is None:
            raise ValueError(
                f"parallel.data_parallel_size = {p.data_parallel_size}: this server's engines (start rank "
                f"{p.data_parallel_start_rank}, parallel.dp = {p.dp}) must lie inside it, and every server needs the "
                "group's parallel.data_parallel_address and data_parallel_rpc_port"
            )
    if p.enable_dbo and not p.enable_expert_parallel:
        raise ValueError("enable_dbo overlaps expert parallelism's all-to-all: set enable_expert_parallel = true")
    if p.eplb_num_redundant_experts and not p.enable_eplb:
        raise ValueError("eplb_num_redundant_experts places replicas for the load balancer: set enable_eplb = true")
    check_deployment(config)


def check_deployment(config: Config) -> None:
    d = config.deployment
    if d.type == "disaggregated":
        if d.replicas != 1 or d.num_nodes != 1:
            raise ValueError(
                "deployment.type = 'disaggregated' counts its servers in num_prefill_replicas and "
                "num_decode_replicas: leave deployment.replicas and num_nodes at 1"
            )
    elif (
        (d.num_prefill_replicas, d.num_decode_replicas, d.num_prefill_nodes, d.num_decode_nodes) != (1, 1, None, None)
        or d.prefill_env_vars
        or d.decode_env_vars
        or d.non_cached_tokens
    ):
        raise ValueError(
            "deployment.num_prefill_*/num_decode_*, prefill_env_vars, decode_env_vars and "
            "non_cached_tokens need deployment.type = 'disaggregated'"
        )
    if d.nodes_per_replica != 1:
        if d.type != "multi_node":
            raise ValueError(
                "deployment.nodes_per_replica needs deployment.type = 'multi_node' (a server spanning Ray nodes); "
                "a disaggregated replica spans num_prefill_nodes / num_decode_nodes"
            )
        if d.num_nodes % d.nodes_per_replica or config.parallel.tp % d.nodes_per_replica:
            raise ValueError(
                f"deployment.nodes_per_replica = {d.nodes_per_replica} must divide deployment.num_nodes "
                f"({d.num_nodes}: whole replicas) and parallel.tp ({config.parallel.tp}: every node runs the same "
                "number of a replica's ranks)"
            )
        if config.parallel.dp != 1:
            raise ValueError("deployment.nodes_per_replica > 1 spreads tensor-parallel ranks only: set parallel.dp = 1")
    p = config.parallel
    if d.type == "disaggregated" and max(d.spans) > 1 and p.dp != 1:
        raise ValueError(
            f"a disaggregated replica on {max(d.spans)} Ray nodes spreads its parallel.tp ranks over them; "
            "data-parallel engines do not span nodes: set parallel.dp = 1 (each node of a tp = 1 replica runs its "
            "own server)"
        )
    if d.type == "multi_node" and p.enable_expert_parallel and d.nodes_per_replica == 1 and d.copy_size > 1:
        if p.dp % d.copy_size or p.data_parallel_size is not None:
            raise ValueError(
                f"multi_node with enable_expert_parallel is Wide-EP: the {d.copy_size} nodes' servers form one expert "
                f"group and parallel.dp ({p.dp}) counts its engines in all, split evenly over the nodes: set "
                f"parallel.dp to a multiple of {d.copy_size} (and leave parallel.data_parallel_size unset)"
            )
    if d.type == "multi_node":
        if d.replicas != 1:
            raise ValueError(
                "deployment.replicas counts replicas on one machine; with type 'multi_node' set "
                "deployment.num_nodes (one replica per Ray node) and leave replicas at 1"
            )
    elif d.num_nodes != 1:
        raise ValueError(
            "deployment.num_nodes needs deployment.type = 'multi_node' (Ray); "
            "for several replicas on this machine set deployment.replicas"
        )
    if d.on_ray and importlib.util.find_spec("ray") is None:
        how = "type 'multi_node'" if d.type == "multi_node" else "num_prefill_nodes / num_decode_nodes"
        raise ValueError(
            f"deployment {how} runs on Ray, which is not installed: pip install 'rlserve[ray]' "
            "(or keep every server on this machine)"
        )
    if not d.enabled:
        return
    port = config.server.port
    if d.admin_port is not None and port and d.admin_port == port:
        raise ValueError(
            f"deployment.admin_port {d.admin_port} equals server.port: give the admin address "
            "its own port (default server.port + 1)"
        )
    admin = d.admin_port if d.admin_port is not None else (port + 1 if port else None)
    routers = [d.router_port(c, port) for c in range(d.copies)]
    if port and (admin in routers or routers[-1] > 65535):
        raise ValueError(
            f"deployment.copies = {d.copies} puts the copies' routers on ports {routers[0]}..{routers[-1]} "
            f"(copy c: server.port + 1 + c), which {'holds the admin port' if admin in routers else 'passes 65535'}; "
            "move deployment.admin_port or server.port"
        )
    if d.backend_port:
        backends = range(d.backend_port, d.backend_port + d.size)
        clash = [p for p in (*routers, admin) if p and p in backends]
        if clash:
            raise ValueError(
                f"deployment.backend_port {d.backend_port}..{backends[-1]} (one port per replica) "
                f"overlaps port {clash[0]}; move deployment.backend_port"
            )
        if backends[-1] > 65535:
            raise ValueError(f"deployment.backend_port {d.backend_port} + {d.size} replicas passes port 65535")
    if not d.on_ray:
        _check_devices(config)


def _check_devices(config: Config) -> None:
    device, n = config.model.device, config.deployment.size
    if device.startswith("cuda") and ":" in device:
        raise ValueError(
            f"model.device {device!r} pins one GPU, but each of the deployment's {n} replicas needs "
            "its own: set model.device = 'cuda' (replica i gets cuda:i)"
        )
    if device == "cuda":
        import torch

        if torch.cuda.device_count() < n:
            raise ValueError(
                f"the deployment has {n} GPU replicas but this machine has "
                f"{torch.cuda.device_count()} GPU(s): lower deployment.replicas (or the prefill/decode "
                "replica counts)"
            )
