"""Whether a config's engine ranks and threads fit this machine: checked by rlserve.cli before any engine
process starts (where that needs no CUDA query), and by the server. Light: torch is imported only to ask
about CUDA."""

from __future__ import annotations

import os

from rlserve.config.schema import Config


def check_parallel(config: Config) -> None:
    """tp * dp against what the machine has; raises ValueError saying what to change."""
    tp, dp = config.parallel.tp, config.parallel.dp
    if dp > 1 and not config.engine.core_process:
        raise ValueError("parallel.dp > 1 runs each engine in its own process: drop engine.core_process=false")
    if tp > 1 and not config.engine.core_process:
        raise ValueError(
            "parallel.tp > 1 runs the engine core process with its worker ranks: drop engine.core_process=false"
        )
    device = config.model.device
    gpus = cuda_devices() if device.startswith("cuda") or device == "auto" else 0
    on_cpu = not (device.startswith("cuda") or gpus)
    if on_cpu:
        have, what = os.cpu_count() or 1, "CPU cores"
        if config.parallel.oversubscribe_cpu:  # asked for: the ranks share the cores, slowly
            return
    else:
        have, what = gpus, "CUDA devices"
    if tp * dp > have:
        also = " (or, on CPU, set parallel.oversubscribe_cpu = true to run it anyway, slowly)" if on_cpu else ""
        raise ValueError(
            f"parallel.tp * parallel.dp = {tp} * {dp} = {tp * dp} needs that many {what}, this machine "
            f"has {have}: lower parallel.dp or parallel.tp{also}"
        )
    # checked before any engine starts (rlserve.cli): torch would start that many OpenMP threads, and a
    # mistyped 100000 takes the machine's last free PIDs from every other process until it is refused
    if on_cpu and config.num_threads and config.num_threads * tp * dp > have:
        ranks = f" per engine rank times {tp * dp} ranks" if tp * dp > 1 else ""
        raise ValueError(
            f"num_threads={config.num_threads}{ranks} oversubscribes the {have} CPU cores: lower num_threads (or "
            "leave it unset to split the cores evenly; parallel.oversubscribe_cpu = true runs it anyway, slowly)"
        )


def check_before_start(config: Config) -> None:
    """check_parallel, where it can run before the engine process starts: on a CPU engine. Counting CUDA
    devices initialises the CUDA driver, and an engine core forked after that could not use the GPU; the
    server checks those configs once the core has started."""
    import torch

    if config.model.device == "cpu" or (config.model.device == "auto" and not torch.backends.cuda.is_built()):
        check_parallel(config)


def cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0
