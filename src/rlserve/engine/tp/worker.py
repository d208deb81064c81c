"""A tensor-parallel worker process (ranks 1..tp-1): `python -m rlserve.engine.tp.worker`, started and stopped by
rank 0 (leader.py) with the config as JSON on stdin, or forked by the engine core before it loaded its model and
told the same later (forked.py). It loads its shard, joins the step group, then runs each step,
stage, commit and discard rank 0 sends, in order. It dies with rank 0 (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist
import zmq

from rlserve.config.schema import Config
from rlserve.engine.child import connect_pair, parent_pid, start_child
from rlserve.engine.tp.comm import (
    DTYPES,
    START_TIMEOUT_S,
    Commit,
    Died,
    Discard,
    KVGather,
    KVWrite,
    Loaded,
    RemoveAdapter,
    Stage,
    Staged,
    Step,
    as_tensor,
    attach,
    device_of_rank,
    encode,
    expert_parallel,
    gather_all,
    gather_bytes,
    make_group,
    send_bytes,
    to_worker,
)
from rlserve.engine.tp.kv_transfer import serve_gather, uses_kv_group, write_slice
from rlserve.model.batch import AttentionBatch, CascadePlan, PrefillSeq
from rlserve.model.shape import ModelShape
from rlserve.model.tensor_parallel import shard

# ---- workers -------------------------------------------------------------------------------

log = logging.getLogger("rlserve.engine.tp.worker")


class Worker:
    def __init__(
        self,
        rank: int,
        tp: int,
        config: Config,
        shape: ModelShape,
        num_blocks: int,
        device: torch.device,
        replies: zmq.Socket,
    ):
        from rlserve.engine.devices import resolve_dtype
        from rlserve.engine.runner import ModelRunner
        from rlserve.engine.weights import StagingBuffers
        from rlserve.model.loader import load_model, resolve_model_dir

        self.rank, self.tp, self.config, self.device, self.replies = rank, tp, config, device, replies
        self.dtype = resolve_dtype(config.model.dtype, device)
        model_dir = resolve_model_dir(config.model.name)
        self.shape = shape
        self.model = load_model(model_dir, self.shape, self.dtype, device, rank, tp, expert_parallel(config, rank))
        ec = config.engine
        self.runner = ModelRunner(
            self.model,
            num_blocks,
            ec.block_size,
            self.dtype,
            device,
            cascade_attention=ec.cascade_attention,
            pack_weights=ec.pack_weights,
            use_cpu_kernels=ec.cpu_kernels,
        )
        self.tiers = None  # this rank's slice of rank 0's KV offload tiers (tp/offload.py)
        if config.kv_cache_offload is not None:
            from rlserve.engine.tp.offload import WorkerTiers

            self.tiers = WorkerTiers(config.kv_cache_offload, self.runner.kv_cache, ec.block_size, rank, tp)
        self.adapters: dict = {}
        self.staged: dict[int, Any] = {}  # call id -> ("weights", StagedWeights) | ("adapter", LoraAdapter)
        self.staged_lock = threading.Lock()
        self.helper = ThreadPoolExecutor(1, thread_name_prefix="rlserve-tp-stage")
        self.buffers = StagingBuffers()
        self.reply_lock = threading.Lock()

    def join_groups(self, store: dist.Store) -> None:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        self.step_group = make_group(store, "step", self.rank, self.tp, backend)
        self.weights_group = make_group(store, "weights", self.rank, self.tp, "gloo")
        if uses_kv_group(self.config):  # as rank 0 makes them, in the same order (tp/kv_transfer.py)
            self.kv_group = make_group(store, "kv", self.rank, self.tp, "gloo")
        attach(self.model, self.step_group, self.rank, self.config)

    def reply(self, msg: Any) -> None:
        with self.reply_lock:
            self.replies.send(encode(msg))

    @torch.inference_mode()
    def run_step(self, msg: Step) -> None:
        dev = self.device
        if msg.offload:  # as rank 0's scheduler moved them, before this step's copies
            self.tiers.apply(msg.offload)
        if msg.block_copies:
            self.runner._copy_blocks(msg.block_copies)
        c = msg.cascade
        cascade = (
            None
            if c is None
            else CascadePlan(
                c.prefix_blocks.to(dev),
                as_tensor(c.prefix_mask, dev),
                c.group_width,
                c.num_grouped,
                as_tensor(c.query_rows, dev),
                c.suffix_blocks.to(dev),
                c.suffix_mask.to(dev),
            )
        )
        lora = None
        if msg.lora:
            from rlserve.model.lora import LoraBatch

            lora = LoraBatch([(self.adapters[name], rows.to(dev)) for name, rows in msg.lora], self.model.shape)
        kernels = self.runner.kernels if msg.kernels else None
        if msg.kernels and kernels is None:
            raise RuntimeError("rank 0 runs the C kernels and this rank cannot load them")
        attn = AttentionBatch(
            slot_mapping=msg.slot_mapping.to(dev),
            num_decode=msg.num_decode,
            decode_blocks=as_tensor(msg.decode_blocks, dev),
            decode_mask=as_tensor(msg.decode_mask, dev),
            decode_lens=as_tensor(msg.decode_lens, dev),
            cascade=cascade,
            prefills=[
                PrefillSeq(p.q_start, p.q_len, p.ctx_len, as_tensor(p.ctx_slots, dev), as_tensor(p.mask, dev))
                for p in msg.prefills
            ],
            block_size=msg.block_size,
            lora=lora,
            kernels=kernels,
        )
        self.model(msg.input_ids.to(dev), msg.positions.to(dev), attn, self.runner.kv_cache)

    # staged work runs in the helper thread, so steps go on meanwhile
    def stage(self, msg: Stage) -> None:
        from rlserve.engine.error_kinds import error_kind

        try:
            staged = self._stage(msg)
        except Exception as exc:
            self.reply(Staged(self.rank, msg.call_id, error_kind(exc), str(exc)))
            return
        with self.staged_lock:
            self.staged[msg.call_id] = staged
        self.reply(Staged(self.rank, msg.call_id, None, None))

    def _stage(self, msg: Stage) -> Any:
        from rlserve.engine.weights import StagedWeights, check_under_roots, stage_from_dir

        if msg.kind == "dir":
            weight_dir, roots = msg.args
            return "weights", stage_from_dir(self.model, check_under_roots(weight_dir, roots), self.buffers, roots)
        if msg.kind == "adapter":
            from rlserve.model.lora import load_peft_adapter
            from rlserve.model.tensor_parallel import shard_adapter

            name, path, roots = msg.args
            adapter = load_peft_adapter(
                name, check_under_roots(path, roots), self.shape, self.dtype, self.device, roots
            )
            return "adapter", shard_adapter(adapter, self.rank, self.tp)
        if msg.kind == "push":
            tensors = {}
            whole = self.config.parallel.enable_expert_parallel
            for name, dtype, full in msg.args:
                dt = DTYPES[dtype]
                part = torch.empty(
                    shard(name, torch.empty(full, dtype=dt, device="meta"), self.rank, self.tp, whole).shape, dtype=dt
                )
                raw = send_bytes(self.weights_group, part, self.rank, self.tp, name, whole)
                tensors[name] = raw.view(dt).view(part.shape).to(self.device)
            # rank 0 validated the full tensors already; these are this rank's slices
            return "weights", StagedWeights(tensors, "broadcast", sharded=True)
        if msg.kind == "gather":  # a deployment's copy of the served weights: this rank's slices to rank 0
            from rlserve.model.loader import target_of

            params = dict(self.model.named_parameters())
            whole = self.config.parallel.enable_expert_parallel
            names, slots = msg.args
            for name in names:
                gather_bytes(
                    self.weights_group, target_of(self.model, params, name).cpu(), self.rank, self.tp, name, whole
                )
            for name in slots:  # expert parallelism: this rank's own experts
                gather_all(self.weights_group, params[name].cpu(), self.rank, self.tp)
            return "gathered", None
        raise ValueError(f"unknown staged work {msg.kind!r}")

    def commit(self, call_id: int) -> None:
        from rlserve.engine.weights import commit

        with self.staged_lock:
            kind, staged = self.staged.pop(call_id)
        if kind == "weights":
            commit(self.model, staged)
        else:
            self.adapters[staged.name] = staged

    def serve(self, inbox: zmq.Socket) -> None:
        parent = parent_pid()
        while True:
            if not inbox.poll(1000):
                if os.getppid() != parent:
                    return
                continue
            msg = to_worker.decode(inbox.recv())
            if isinstance(msg, Step):
                self.run_step(msg)
            elif isinstance(msg, Stage):
                self.helper.submit(self.stage, msg)
            elif isinstance(msg, Commit):
                self.commit(msg.call_id)
            elif isinstance(msg, Discard):
                with self.staged_lock:
                    self.staged.pop(msg.call_id, None)
            elif isinstance(msg, RemoveAdapter):
                self.adapters.pop(msg.name, None)
            elif isinstance(msg, KVGather):
                serve_gather(
                    self.kv_group, self.runner.kv_cache, self.config.engine.block_size, self.rank, self.tp, msg
                )
            elif isinstance(msg, KVWrite):
                write_slice(self.runner.kv_cache, msg.blocks, self.config.engine.block_size, msg.kv.to(self.device))
            else:
                return


def worker_main(argv: list[str]) -> int:
    """`python -m rlserve.engine.tp.worker ARGS`, the config on stdin (a spawned worker)."""
    config = start_child()
    if config is None:
        return 1
    return serve_rank(argv, config)


def serve_rank(argv: list[str], config: Config) -> int:
    """Rank `argv[0]` of `argv[1]`, spawned or forked (tp/forked.py): load the shard, join the groups, serve."""
    rank, tp, store_addr, inbox_addr, reply_addr, num_blocks, device, shape = argv
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    rank_i, tp_i = int(rank), int(tp)
    dev = device_of_rank(torch.device(device), rank_i)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    inbox, replies = connect_pair(zmq.Context(), inbox_addr, reply_addr, 2000)
    try:
        worker = Worker(rank_i, tp_i, config, ModelShape.from_dict(json.loads(shape)), int(num_blocks), dev, replies)
        store_host, store_port = store_addr.rsplit(":", 1)
        store = dist.TCPStore(
            store_host, int(store_port), tp_i, False, timeout=datetime.timedelta(seconds=START_TIMEOUT_S)
        )
        replies.send(encode(Loaded(rank_i)))
        worker.join_groups(store)
        try:
            worker.serve(inbox)
        finally:  # os._exit below skips the disk tier's own clean-up
            if worker.tiers is not None:
                worker.tiers.close()
    except BaseException as exc:
        log.exception("tensor-parallel rank %s died", rank)
        replies.send(encode(Died(rank_i, repr(exc))))
        return 1
    finally:
        inbox.close(linger=0)
        replies.close(linger=2000)
    return 0


if __name__ == "__main__":
    code = worker_main(sys.argv[1:])
    sys.stdout.flush()
    os._exit(code)  # without waiting for the helper thread
