"""What tensor-parallel ranks share: the messages rank 0 and its workers exchange (fixed-schema msgspec over
ZeroMQ, never pickle), the step group and its all-reduce, and the byte scatter that ships weights.
Rank 0's side is leader.py, the worker processes' worker.py."""

from __future__ import annotations

import datetime
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from rlserve.config.schema import Config
from rlserve.model.batch import AttentionBatch
from rlserve.model.llama import CausalLM
from rlserve.model.tensor_parallel import shard, shard_dim

COLLECTIVE_TIMEOUT_S = 120.0  # a rank waiting this long in one collective gives up (the other is gone or stuck)
START_TIMEOUT_S = 600.0  # a worker loading its shard
POLL_MS = 200

# ---- wire: rank 0 -> workers ---------------------------------------------------------------

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.int64, torch.int32, torch.bool, torch.float32, torch.bfloat16, torch.float16, torch.float64)
}


class Tensor(msgspec.Struct, array_like=True):
    dtype: str  # one of DTYPES
    shape: list[int]
    data: bytes

    @classmethod
    def of(cls, t: torch.Tensor | None) -> Tensor | None:
        if t is None:
            return None
        t = t.detach().contiguous().cpu()
        return cls(str(t.dtype).removeprefix("torch."), list(t.shape), t.view(-1).view(torch.uint8).numpy().tobytes())

    def to(self, device: torch.device) -> torch.Tensor:
        dtype = DTYPES[self.dtype]
        raw = (
            torch.frombuffer(bytearray(self.data), dtype=torch.uint8)
            if self.data
            else torch.empty(0, dtype=torch.uint8)
        )
        return raw.view(dtype).view(self.shape).to(device)


def as_tensor(t: Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if t is None else t.to(device)


class Prefill(msgspec.Struct, array_like=True):
    q_start: int
    q_len: int
    ctx_len: int
    ctx_slots: Tensor | None
    mask: Tensor | None


class Cascade(msgspec.Struct, array_like=True):
    prefix_blocks: Tensor
    prefix_mask: Tensor | None
    group_width: int
    num_grouped: int
    query_rows: Tensor | None
    suffix_blocks: Tensor
    suffix_mask: Tensor


class Move(msgspec.Struct, array_like=True):
    """One block move of rank 0's KV offload tiers (kv/offload.py), for each worker to replay on its slice."""

    kind: str  # save | spill | drop | load | load_disk | generation
    block: int  # pool block (save, load, load_disk)
    slot: int  # CPU-tier slot (save, spill, load); the weight generation (generation)
    key: bytes  # the block's chained hash (spill, drop, load_disk)


class Step(msgspec.Struct, tag=True, array_like=True):
    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    num_decode: int
    decode_blocks: Tensor | None
    decode_mask: Tensor | None
    decode_lens: Tensor | None
    cascade: Cascade | None
    prefills: list[Prefill]
    block_size: int
    lora: list[tuple[str, Tensor]]  # (adapter name, its rows)
    block_copies: list[tuple[int, int]]
    kernels: bool  # rank 0 ran the C kernels (no decode mask was built): so must every rank
    offload: list[Move] = []  # rank 0's tier moves since the last step, before this step's copies and forward


class Stage(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    kind: str  # dir [weight_dir, roots] | adapter [name, path, roots] | push [[name, dtype, full shape], ...]
    # | gather [checkpoint names, expert slot parameters]
    args: list[Any]


class Commit(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class Discard(msgspec.Struct, tag=True, array_like=True):
    call_id: int


class RemoveAdapter(msgspec.Struct, tag=True, array_like=True):
    name: str


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


class KVGather(msgspec.Struct, tag=True, array_like=True):
    """P/D transfer (tp/kv_transfer.py): send rank 0 this rank's slice of these pool blocks over the kv group."""

    blocks: list[int]


class KVWrite(msgspec.Struct, tag=True, array_like=True):
    """P/D transfer: this rank's slice of pulled blocks, `[layers, 2, len(blocks) * block_size, heads, dim]`."""

    blocks: list[int]
    kv: Tensor


ToWorker = Step | Stage | Commit | Discard | RemoveAdapter | Stop | KVGather | KVWrite

# ---- wire: workers -> rank 0 ---------------------------------------------------------------


class Loaded(msgspec.Struct, tag=True, array_like=True):
    rank: int


class Staged(msgspec.Struct, tag=True, array_like=True):
    rank: int
    call_id: int
    error_kind: str | None
    error: str | None


class Died(msgspec.Struct, tag=True, array_like=True):
    rank: int
    message: str


ToLeader = Loaded | Staged | Died
encode = msgspec.msgpack.Encoder().encode
to_worker = msgspec.msgpack.Decoder(ToWorker)
to_leader = msgspec.msgpack.Decoder(ToLeader)


def encode_step(
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    attn: AttentionBatch,
    block_copies: list[tuple[int, int]],
    offload: list[Move] | None = None,
) -> bytes:
    c = attn.cascade
    cascade = (
        None
        if c is None
        else Cascade(
            Tensor.of(c.prefix_blocks),
            Tensor.of(c.prefix_mask),
            c.group_width,
            c.num_grouped,
            Tensor.of(c.query_rows),
            Tensor.of(c.suffix_blocks),
            Tensor.of(c.suffix_mask),
        )
    )
    lora = [] if attn.lora is None else [(adapter.name, Tensor.of(rows)) for adapter, rows in attn.lora.segments]
    return encode(
        Step(
            Tensor.of(input_ids),
            Tensor.of(positions),
            Tensor.of(attn.slot_mapping),
            attn.num_decode,
            Tensor.of(attn.decode_blocks),
            Tensor.of(attn.decode_mask),
            Tensor.of(attn.decode_lens),
            cascade,
            [Prefill(p.q_start, p.q_len, p.ctx_len, Tensor.of(p.ctx_slots), Tensor.of(p.mask)) for p in attn.prefills],
            attn.block_size,
            lora,
            [tuple(c) for c in block_copies],
            attn.kernels is not None,
            offload or [],
        )
    )


# ---- process groups ------------------------------------------------------------------------


def make_group(
    store: dist.Store, name: str, rank: int, world: int, backend: str, timeout_s: float = COLLECTIVE_TIMEOUT_S
) -> Any:
    """A process group of its own (not torch.distributed's default one, which a trainer broadcaster uses)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    prefixed = dist.PrefixStore(name, store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    return dist.ProcessGroupGloo(prefixed, rank, world, timeout)


def expert_parallel(config: Config, rank: int) -> tuple[int, int, int] | None:
    """(ep rank, ep size, redundant experts) of tensor-parallel rank `rank` under enable_expert_parallel:
    the experts spread over every rank of the tp * dp engines."""
    p = config.parallel
    if not p.enable_expert_parallel or p.tp * p.dp_total == 1:
        return None
    return p.data_parallel_rank * p.tp + rank, p.tp * p.dp_total, p.eplb_num_redundant_experts


def expert_group(config: Config, ep_rank: int, backend: str) -> Any:
    """The expert-parallel group over every rank of the dp engines (engine 0's rank 0 hosts the store)."""
    p = config.parallel
    if p.data_parallel_rpc_port is None:
        raise ValueError("expert parallelism over parallel.dp engines needs parallel.data_parallel_rpc_port")
    timeout = datetime.timedelta(seconds=START_TIMEOUT_S)
    world = p.tp * p.dp_total
    store = dist.TCPStore(p.data_parallel_address, p.data_parallel_rpc_port, world, ep_rank == 0, timeout=timeout)
    # the group holds on to its store
    return make_group(store, "experts", ep_rank, world, backend, p.expert_group_timeout_s)


def attach(model: CausalLM, group: Any, rank: int = 0, config: Config | None = None) -> None:
    """Make the row-parallel layers (o_proj, down_proj) sum their partial outputs across ranks; expert-
    parallel layers dispatch over the same group (dp = 1) or over every rank of the dp engines, each
    rank a slice of its engine's tokens. `group` is None for an engine of one rank."""
    from rlserve.model import expert_parallel as ep

    placed = None if config is None else expert_parallel(config, rank)
    if placed is not None:
        p = config.parallel
        experts = group if p.dp_total == 1 else expert_group(config, placed[0], "nccl" if _on_cuda(model) else "gloo")
        ep.attach(model, experts, (rank, p.tp), p.eplb_step_interval if p.enable_eplb else 0, p.enable_dbo)
    if group is None:
        return

    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.contiguous()  # the swapped CPU GEMM returns a transposed view
        group.allreduce([t]).wait()
        return t

    for layer in model.layers:
        layer.self_attn.reduce = all_reduce
        layer.mlp.reduce = all_reduce


def _on_cuda(model: CausalLM) -> bool:
    return model.norm.device.type == "cuda"


def device_of_rank(device: torch.device, rank: int) -> torch.device:
    """CPU for every rank; on CUDA one device per rank, counting from rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def send_bytes(
    group: Any, tensor: torch.Tensor, rank: int, tp: int, name: str, experts_whole: bool = False
) -> torch.Tensor | None:
    """Scatter `name`'s slices from rank 0 (or broadcast it whole when it is replicated); returns
    this rank's part on workers. Bytes on gloo, so any dtype crosses."""
    dim = shard_dim(name, experts_whole)
    if dim is None:
        flat = tensor.contiguous().view(-1).view(torch.uint8)
        group.broadcast([flat], _root0(dist.BroadcastOptions())).wait()
        return flat
    if rank == 0:
        parts = [shard(name, tensor, r, tp, experts_whole).contiguous().view(-1).view(torch.uint8) for r in range(tp)]
        group.scatter([torch.empty_like(parts[0])], [parts], _root0(dist.ScatterOptions())).wait()
        return None
    out = torch.empty(tensor.numel() * tensor.element_size(), dtype=torch.uint8)
    group.scatter([out], [], _root0(dist.ScatterOptions())).wait()
    return out


def gather_bytes(
    group: Any, part: torch.Tensor, rank: int, tp: int, name: str, experts_whole: bool = False
) -> list[torch.Tensor] | None:
    """`send_bytes` reversed: every rank's slice of `name` to rank 0, which gets them in rank order (a
    replicated tensor is rank 0's own). Bytes on gloo."""
    if shard_dim(name, experts_whole) is None:
        return [part] if rank == 0 else None
    return gather_all(group, part, rank, tp)


def gather_all(group: Any, part: torch.Tensor, rank: int, tp: int) -> list[torch.Tensor] | None:
    """Every rank's `part` (one shape on all ranks) to rank 0, in rank order. Bytes on gloo."""
    flat = part.contiguous().view(-1).view(torch.uint8)
    if rank != 0:
        group.gather([], [flat], _root0(dist.GatherOptions())).wait()
        return None
    out = [torch.empty_like(flat) for _ in range(tp)]
    group.gather([out], [flat], _root0(dist.GatherOptions())).wait()
    return [o.view(part.dtype).view(part.shape) for o in out]


def _root0(opts: Any) -> Any:
    opts.rootRank = 0
    return opts


# ---- rank 0 --------------------------------------------------------------------------------
