"""`parallel.dp = k`: k engine core processes behind one API server, with one engine's face.

A request goes to the engine its `X-data-parallel-rank` header names (what vllm-router's
intra-node data parallelism sends); else `X-Session-ID` picks one by a stable hash, so a
session's prefix cache stays warm; else the engine with the fewest requests in flight.
Control operations reach every engine; the mirrored facts are engine 0's.
"""

from __future__ import annotations

import asyncio
import os
import zlib
from collections.abc import AsyncIterator
from contextvars import ContextVar
from typing import Any

from rlserve.config.schema import Config
from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.runtime.face import FaceRules
from rlserve.runtime.machine_fit import cuda_devices
from rlserve.runtime.ports import free_port
from rlserve.runtime.proc_client import EngineClient

# (X-data-parallel-rank, X-Session-ID) of the HTTP request being served; set by the server's middleware
routing_hint: ContextVar[tuple[str | None, str | None]] = ContextVar("routing_hint", default=(None, None))
# the engine serving the current task's request, set once it is picked (the server's metrics label it so)
served_by: ContextVar[int] = ContextVar("served_by", default=0)


def engine_config(config: Config, index: int, expert_port: int | None = None) -> Config:
    """Each engine's config: its share of the cores, its own seed (unseeded samples differ across engines),
    and under expert parallelism its rank in the expert group (Wide-EP: counted from this server's start rank)
    and that group's rendezvous port."""
    p = config.parallel
    rank = p.data_parallel_start_rank + index
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // (p.dp * p.tp))
    update: dict = {"seed": config.seed + rank, "num_threads": threads}
    if expert_port is not None:
        update["parallel"] = p.model_copy(update={"data_parallel_rank": rank, "data_parallel_rpc_port": expert_port})
    device = config.model.device
    if p.dp > 1 and (device == "cuda" or (device == "auto" and cuda_devices())):
        # each engine its own devices: engine i's tensor-parallel ranks use cuda:i*tp .. cuda:i*tp+tp-1
        update["model"] = config.model.model_copy(update={"device": f"cuda:{index * p.tp}"})
    return config.model_copy(update=update)


class DataParallelClient(FaceRules):
    """`dead` is its engines'. Updates queue on this face's own lock before they fan out, so an update
    whose caller left while it waited is dropped here, as with one engine."""

    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        self.engines: list[EngineClient] = []
        p = config.parallel
        expert_port = (p.data_parallel_rpc_port or free_port()) if p.enable_expert_parallel else None
        try:
            fork = config.engine.core_start == "fork"  # the server has run no torch op yet
            for index in range(config.parallel.dp):
                self.engines.append(EngineClient(engine_config(config, index, expert_port), wait=False, fork=fork))
            for engine in self.engines:
                engine.wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self.in_flight = [0] * len(self.engines)
        first = self.engines[0]
        self.tokenizer, self.model_dir, self.shape = first.tokenizer, first.model_dir, first.shape
        self.max_model_len, self.vocab_size = first.max_model_len, first.vocab_size

    # ---- mirrored facts ---------------------------------------------------------------------

    @property
    def dead(self) -> BaseException | None:
        return next((e.dead for e in self.engines if e.dead is not None), None)

    @property
    def policy_version(self) -> int:
        return self.engines[0].policy_version

    @property
    def weight_version(self) -> str:
        return self.engines[0].weight_version

    @property
    def adapters(self) -> dict[str, str]:
        return self.engines[0].adapters

    @property
    def paused(self) -> bool:
        return all(e.paused for e in self.engines)

    @property
    def stats(self):
        return self.engines[0].stats

    # ---- routing ----------------------------------------------------------------------------

    def pick(self) -> int:
        rank, session = routing_hint.get()
        if rank is not None:
            try:
                index = int(rank)
            except ValueError:
                index = -1
            if not 0 <= index < len(self.engines):
                raise ValueError(
                    f"X-data-parallel-rank {rank!r} names no engine: this server runs ranks "
                    f"0..{len(self.engines) - 1} (parallel.dp={len(self.engines)})"
                )
            return index
        if session:
            return zlib.crc32(session.encode()) % len(self.engines)
        return min(range(len(self.engines)), key=self.in_flight.__getitem__)

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        *,
        cache_salt: str | None = None,
        adapter: str | None = None,
        stream: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        index = self.pick()
        served_by.set(index)  # an async generator shares its caller's context: the caller reads it
        self.in_flight[index] += 1
        try:
            async for out in self.engines[index].generate(
                prompt, params, request_id, cache_salt=cache_salt, adapter=adapter, stream=stream
            ):
                yield out
        finally:
            self.in_flight[index] -= 1

    # ---- every engine -----------------------------------------------------------------------

    async def _all(self, op: str, *args: Any) -> list[Any]:
        return list(await asyncio.gather(*(getattr(e, op)(*args) for e in self.engines)))

    async def start(self) -> None:
        await self._all("start")

    async def refresh(self) -> None:
        await self._all("refresh")

    async def abort(self, request_id: str) -> int:
        return sum(await self._all("abort", request_id))

    async def abort_requests(self, request_ids: list[str] | None = None) -> int:
        return sum(await self._all("abort_requests", request_ids))

    async def pause(self, mode: str = "keep") -> int:
        return sum(await self._all("pause", mode))

    async def resume(self, steps: int | None = None) -> None:
        """With `steps`, each rank runs that many of its own steps."""
        await self._all("resume", steps)

    async def reset_prefix_cache(self) -> bool:
        return all(await self._all("reset_prefix_cache"))

    async def update_weights_from_dir(
        self,
        weight_dir: str,
        roots: list[str],
        weight_version: str | None = None,
        started: asyncio.Event | None = None,
        inflight: str | None = None,
    ) -> int:
        async with self._update_turn(started):
            return (await self._all("update_weights_from_dir", weight_dir, roots, weight_version, None, inflight))[0]

    async def init_broadcaster(
        self, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0
    ) -> None:
        # each engine is its own member of the trainer's group, at consecutive ranks
        await asyncio.gather(
            *(e.init_broadcaster(host, port, rank + i, world_size, timeout_s) for i, e in enumerate(self.engines))
        )

    async def update_weights_from_broadcast(
        self, weight_version: str | None = None, started: asyncio.Event | None = None, inflight: str | None = None
    ) -> int:
        async with self._update_turn(started):
            return (await self._all("update_weights_from_broadcast", weight_version, None, inflight))[0]

    async def set_versions(self, policy_version: int, label: str) -> None:
        await self._all("set_versions", policy_version, label)

    async def has_unfinished(self) -> bool:
        return any(await self._all("has_unfinished"))

    async def load_adapter(self, name: str, path: str, roots: list[str]) -> int:
        return (await self._all("load_adapter", name, path, roots))[0]

    async def remove_adapter(self, name: str) -> int:
        return sum(await self._all("remove_adapter", name))

    async def set_weight_version(self, label: str, abort_all: bool = False) -> int:
        return sum(await self._all("set_weight_version", label, abort_all))

    def shutdown(self) -> None:
        for engine in self.engines:
            engine.shutdown()
