"""Tensor-parallel ranks on other Ray nodes: one server spanning several nodes.

A Ray deployment (deploy/ray_nodes.py) reserves a bundle on each node of a spanning server and writes
`parallel.ray_ranks` into the server's config: the cluster, the placement group by name, and the bundle of each
rank. Rank 0 (leader.py) starts the ranks of its own bundle as local processes, as on one machine, and each other
rank through a small actor on that rank's bundle, which runs the same `python -m rlserve.engine.tp.worker`
process there. The ranks then meet exactly as local ones do (TCP store, ZeroMQ, gloo), at the node's address.

The actors are owned by rank 0's process: when it exits, Ray ends them, and a worker dies with its actor
(PR_SET_PDEATHSIG), so nothing of a spanning server outlives rank 0.
"""

from __future__ import annotations

import subprocess

from rlserve.config.schema import RayRanksConfig
from rlserve.engine.child import start_tp_worker


class RankHost:
    """Ray actor on a rank's node: runs and watches that rank's worker process."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def start(self, args: list[str], payload: bytes) -> int:
        self.proc = start_tp_worker(args, payload)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout_s: float) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


class ActorExit:
    """A Ray actor's exit code, asked without blocking: each call returns the answer of the last finished `poll()`
    on the actor (None while it runs or while the question is in flight). A slow answer from a busy node is not a
    death; Ray reporting the actor or its node gone is (-1)."""

    def __init__(self, actor) -> None:
        self._actor = actor
        self._pending = None
        self.code: int | None = None

    def __call__(self) -> int | None:
        import ray

        if self.code is not None:
            return self.code
        if self._pending is None:
            self._pending = self._actor.poll.remote()
        done, _ = ray.wait([self._pending], timeout=0)
        if done:
            ref, self._pending = self._pending, None
            try:
                self.code = ray.get(ref)
            except ray.exceptions.RayActorError:
                self.code = -1
        return self.code


class RayRank:
    """Rank 0's handle on a rank on another node, shaped like the subprocess.Popen of a local rank."""

    def __init__(self, ranks: RayRanksConfig, rank: int, args: list[str], payload: bytes):
        import ray
        from ray.util import get_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        strategy = PlacementGroupSchedulingStrategy(
            placement_group=get_placement_group(ranks.placement_group),
            placement_group_bundle_index=ranks.bundles[rank],
        )
        self.actor = ray.remote(num_cpus=1, max_concurrency=4)(RankHost).options(scheduling_strategy=strategy).remote()
        self.pid: int = ray.get(self.actor.start.remote(args, payload))
        self._exit = ActorExit(self.actor)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """Never blocks (see ActorExit)."""
        if self.returncode is None:
            self.returncode = self._exit()
        return self.returncode

    def wait(self, timeout: float) -> int:
        try:
            self.returncode = self._ray.get(self.actor.stop.remote(timeout), timeout=timeout + 30)
        except (self._ray.exceptions.RayError, self._ray.exceptions.GetTimeoutError):
            self.returncode = -1
        self._ray.kill(self.actor)
        return self.returncode if self.returncode is not None else -1

    def kill(self) -> None:
        self._ray.kill(self.actor)


def join_cluster(ranks: RayRanksConfig) -> str:
    """Connect this process to the deployment's cluster; returns this node's address, where the ranks meet."""
    import ray

    if not ray.is_initialized():
        ray.init(address=ranks.address, namespace=ranks.namespace, log_to_driver=True, configure_logging=False)
    return ray.util.get_node_ip_address()


def leave_cluster() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()
