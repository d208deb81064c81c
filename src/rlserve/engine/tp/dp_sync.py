"""Data-parallel engines sharing expert-parallel layers step together (vLLM's DP+EP): every sparse layer's
all-to-all needs every rank of every engine. Each loop turn the engines' rank 0s all-reduce whether any
has work; when one has, every engine runs exactly one forward: its own step, or, with nothing to run, a
dummy forward of one token written to the KV cache's scratch block (outputs dropped)."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from rlserve.config.schema import Config
from rlserve.engine.tp.comm import START_TIMEOUT_S, make_group
from rlserve.model.batch import AttentionBatch, PrefillSeq


class DataParallelSync:
    def __init__(self, config: Config):
        p = config.parallel
        timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
        # engine 0's rank 0 hosts this store for the expert group (comm.expert_group)
        self.store = dist.TCPStore(p.data_parallel_address, p.data_parallel_rpc_port, None, False, timeout=timeout)
        self.group = make_group(
            self.store, "dp-sync", p.data_parallel_rank, p.dp_total, "gloo", p.expert_group_timeout_s
        )
        self.peers_busy = False
        self.dummy_steps = 0

    def any_busy(self, busy: bool) -> bool:
        flag = torch.tensor([int(busy)])
        self.group.allreduce([flag]).wait()
        self.peers_busy = bool(flag.item())
        return self.peers_busy

    def step(self, engine, paused: bool) -> list:
        """One turn of the lock-step: the requests the engine's own step touched (none on a dummy turn)."""
        mine = engine.has_unfinished() and not paused
        if not self.any_busy(mine):
            return engine.take_pending() if paused else []
        if not mine:
            self.dummy_forward(engine.runner)
            return engine.take_pending() if paused else []
        before = engine.scheduler.stats.num_steps
        touched = engine.step_requests()
        if engine.scheduler.stats.num_steps == before:  # scheduled nothing this turn: the peers still forward
            self.dummy_forward(engine.runner)
        return touched

    @torch.inference_mode()
    def dummy_forward(self, runner) -> None:
        dev = runner.device
        slot = torch.tensor([runner.scratch_block * runner.block_size], device=dev)
        attn = AttentionBatch(
            slot_mapping=slot,
            num_decode=0,
            decode_blocks=None,
            decode_mask=None,
            decode_lens=None,
            cascade=None,
            prefills=[PrefillSeq(0, 1, 1, None, None)],
            block_size=runner.block_size,
            lora=None,
            kernels=runner.kernels,
        )
        ids = torch.zeros(1, dtype=torch.long, device=dev)
        if runner.tp is not None:
            runner.tp.send_step(ids, ids, attn, [])
        runner.model(ids, ids, attn, runner.kv_cache)
        self.dummy_steps += 1
