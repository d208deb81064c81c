"""Tensor-parallel workers forked by the engine core before it loads its model (engine.core_start = "fork").

A spawned worker spends ~3.5 s of CPU importing torch and the engine; a fork starts with them imported, as the
forked engine core does (runtime/spawn.py). But rank 0 starts its workers only once its model is loaded and
its KV cache sized, and by then it has run torch ops: GNU OpenMP's thread pool does not survive a fork. So
the core forks one child for each worker rank on its own machine first, before any torch op, and each child
waits on a pipe. Rank 0 later writes it the arguments and config a spawned worker gets (leader.py), and the
child serves as that rank (worker.py). A child that is never told reads the pipe's end and exits: the core
failed before starting its ranks, or exited.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess

from rlserve.config.load import configure_logging
from rlserve.config.schema import Config
from rlserve.engine.child import ForkedProcess, as_forked_child, can_fork, fork_child
from rlserve.engine.tp.worker import serve_rank

_waiting: dict[int, tuple[ForkedProcess, int]] = {}  # rank -> (its child, the pipe's write end)


def on_rank0_machine(config: Config, rank: int) -> bool:
    """Whether `rank` runs on rank 0's machine (a child process of rank 0) rather than on another Ray node."""
    ranks = config.parallel.ray_ranks
    return ranks is None or ranks.bundles[rank] == ranks.bundles[0]


def fork_waiting_workers(config: Config) -> None:
    """Fork a waiting child for each local worker rank; call before the first torch op. Nothing where
    engine.core_start is "spawn" or forking is unsafe (child.can_fork): rank 0 spawns its workers then."""
    tp = config.parallel.tp
    if config.engine.core_start != "fork" or tp < 2 or not can_fork():
        return
    parent = os.getpid()
    for rank in range(1, tp):
        if not on_rank0_machine(config, rank):
            continue
        read_end, write_end = os.pipe()
        # the child closes the write ends, its own and the earlier ranks' (or those would never read their end)
        write_ends = [write_end, *(fd for _, fd in _waiting.values())]
        child = fork_child(functools.partial(_wait_then_serve, rank, tp, read_end, write_ends, parent))
        os.close(read_end)
        _waiting[rank] = (child, write_end)


def start(rank: int, args: list[str], payload: bytes) -> ForkedProcess | None:
    """Hand `rank`'s waiting child the arguments and config (JSON) a spawned worker gets; None when no child
    waits for that rank."""
    waiting = _waiting.pop(rank, None)
    if waiting is None:
        return None
    proc, write_end = waiting
    try:
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(json.dumps(args).encode() + b"\n" + payload)
    except BrokenPipeError:  # the child is gone: rank 0's check of its workers reports its exit
        pass
    return proc


def release() -> None:
    """Let the children no rank was started on go (they read the pipe's end and exit), and reap them."""
    while _waiting:
        _, (proc, write_end) = _waiting.popitem()
        os.close(write_end)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _wait_then_serve(rank: int, tp: int, read_end: int, write_ends: list[int], parent: int) -> int:
    for fd in write_ends:
        os.close(fd)
    if not as_forked_child(parent, f"rlserve.engine.tp.worker {rank} {tp}"):  # named as ps names a spawned one
        return 1
    with os.fdopen(read_end, "rb") as pipe:
        told = pipe.read()
    if not told:
        return 0
    args, payload = told.split(b"\n", 1)
    config = Config.model_validate_json(payload)
    configure_logging(config)
    return serve_rank(json.loads(args), config)
