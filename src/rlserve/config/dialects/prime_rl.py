"""prime-rl's inference configs as written in its docs: an `[inference]` table inside an RL config (or the
standalone layout), `model` as a string, its field names, `vllm_extra`, and the RL-level `[deployment]`.

The result is a mapping in rlserve's own layout; config_loader checks every key of it as usual.
"""

from __future__ import annotations

import logging
from typing import Any

from rlserve.config.errors import ConfigError

log = logging.getLogger("rlserve.config.schema")

RL_COMPONENTS = ("inference", "trainer", "orchestrator")  # top-level tables that make a file an RL config
RL_DEPLOYMENT_KEYS = {
    "num_train_nodes",
    "num_infer_nodes",
    "num_infer_replicas",
    "num_train_gpus",
    "num_infer_gpus",
    "gpus_per_node",
}
_TO_PARALLEL = (
    "enable_expert_parallel",
    "enable_eplb",
    "enable_dbo",
)  # prime-rl's [inference] keys, rlserve's [parallel] ones


def from_prime_rl(data: dict[str, Any]) -> dict[str, Any]:
    """rlserve's own layout passes through untouched (apart from the docs' aliases, which it lacks)."""
    rl_deployment = None
    if any(key in data for key in RL_COMPONENTS) or _is_rl_deployment(data.get("deployment")):
        ignored = sorted(k for k in data if k not in ("inference", "deployment"))
        inference = data.get("inference") or {}
        if not isinstance(inference, dict):
            raise ConfigError("inference must be a table")
        rl_deployment = data.get("deployment") if _is_rl_deployment(data.get("deployment")) else None
        if ignored:
            log.warning(
                "prime-rl config: serving its [inference] table; ignored the other components' tables: %s",
                ", ".join(ignored),
            )
        data = dict(inference)
    else:
        data = dict(data)
    _aliases(data)
    if rl_deployment is not None:
        _read_rl_deployment(rl_deployment, data)
    return data


def _is_rl_deployment(table: Any) -> bool:
    return isinstance(table, dict) and bool(RL_DEPLOYMENT_KEYS & set(table))


def _aliases(data: dict[str, Any]) -> None:
    if isinstance(data.get("model"), str):
        data["model"] = {"name": data["model"]}
    for key in _TO_PARALLEL:
        if key in data:
            parallel = data["parallel"] = dict(data.get("parallel") or {})
            parallel[key] = data.pop(key)
    deployment = data.get("deployment")
    if isinstance(deployment, dict):
        deployment = data["deployment"] = dict(deployment)
        if "num_replicas" in deployment:
            deployment["replicas"] = deployment.pop("num_replicas")
        router = deployment.get("router")
        if isinstance(router, dict):
            router = deployment["router"] = dict(router)
            if router.get("type") == "llm-d":
                raise ConfigError(
                    'deployment.router.type "llm-d": rlserve cannot start llm-d\'s endpoint picker (a Go service '
                    'shipped as a container image, with no Python package to install); use type = "vllm-router" '
                    "(its consistent_hash policy keeps a session's prefix on one replica; cache_aware routes by prefix)"
                )
            if "non_cached_tokens" in router:
                deployment["non_cached_tokens"] = router.pop("non_cached_tokens")
    extra = data.pop("vllm_extra", None)
    if extra:
        _apply_vllm_extra(extra, data)


def _apply_vllm_extra(extra: dict[str, Any], data: dict[str, Any]) -> None:
    """vLLM engine arguments under vLLM's names: the ones rlserve has set its own key; any other is an error."""
    from rlserve.config.dialects.vllm_flags import DATA_PARALLEL, REFUSED, VLLM_FLAGS, data_parallel_settings

    if not isinstance(extra, dict):
        raise ConfigError("vllm_extra must be a table of vLLM engine arguments")
    data_parallel: dict[str, Any] = {}
    for key, value in extra.items():
        flag_name = "--" + str(key).replace("_", "-")
        if flag_name in DATA_PARALLEL:  # read together, as on a launch line
            data_parallel[DATA_PARALLEL[flag_name]] = value
            continue
        flag = VLLM_FLAGS.get(flag_name)
        if flag is None or flag.target is None:
            why = REFUSED.get(flag_name, "rlserve has no such setting")
            raise ConfigError(
                f"vllm_extra.{key}: {why} (vllm_extra sets only the vLLM engine arguments rlserve "
                "also has; see docs/launch.md)"
            )
        if flag.switch:
            value = (flag.const == "true") == bool(value)
        elif flag.convert is not None:
            value = flag.convert(str(value))
        _set(data, flag.target, value)
    for target, value in data_parallel_settings(data_parallel).items():
        _set(data, target, value)


def _set(data: dict[str, Any], target: str, value: Any) -> None:
    """data[section][...][leaf] = value for a dotted rlserve key."""
    *parents, leaf = target.split(".")
    for name in parents:
        data = data.setdefault(name, {})
    data[leaf] = value


def _read_rl_deployment(rl: dict[str, Any], data: dict[str, Any]) -> None:
    """RL-level [deployment]: the inference side is read, the trainer side ignored in one log line."""
    trainer_side = sorted(k for k in rl if k not in ("num_infer_nodes", "num_infer_replicas"))
    if trainer_side:
        log.warning(
            "prime-rl config: RL-level [deployment] fields for the trainer ignored: %s", ", ".join(trainer_side)
        )
    nodes = rl.get("num_infer_nodes")
    deployment = data.setdefault("deployment", {})
    if "num_infer_replicas" in rl:  # k copies of the inference deployment, each behind its own router
        deployment["copies"] = rl["num_infer_replicas"]
    if (
        nodes is not None
        and deployment.get("type") == "multi_node"
        and deployment.setdefault("num_nodes", nodes) != nodes
    ):
        raise ConfigError(
            f"deployment.num_infer_nodes = {nodes} but inference.deployment.num_nodes = "
            f"{deployment['num_nodes']}; make them agree"
        )
