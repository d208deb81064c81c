"""Expert parallelism: each rank of the expert-parallel group holds whole experts (its physical slots), and
a sparse layer sends every token's hidden state to the ranks holding its experts and gets the results back
with two all-to-alls (gloo on CPU, NCCL on GPU: one code path).

The router is replicated and routes every token of the step, so `last_experts` (router replay) holds
logical expert ids for all tokens on every rank, whatever the placement. The placement maps physical slots
to logical experts; the load balancer (enable_eplb) changes it by re-placing and replicating hot experts,
moving weights rank to rank, and a token on a replicated expert goes to replica `token % replicas`.
Ranks that share one step's tokens (the tensor-parallel ranks of one engine) each dispatch a slice of
them and all-reduce the combined rows, so every rank ends with every token's output.
The router and the experts run the one-rank layer's arithmetic (under batch-invariant kernels, theirs), and the
combine adds each token's expert outputs in logical-expert order, as the one-rank layer does: with one rank an
engine (tp = 1), a token's output has one rank's bits whichever ranks computed its experts.

Dual-batch overlap (enable_dbo) splits a rank's tokens into two micro-batches and interleaves their phases, so
one's all-to-all is in flight while the other's experts compute. Every rank issues the same collectives in the
same order (a micro-batch may be empty), and each token's output is computed as without it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Generator, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from rlserve.model.eplb import Placement, rebalanced, transfers
from rlserve.model.moe import SparseMoe, combine
from rlserve.model.shape import MoeShape
from rlserve.model.tensor_parallel import is_expert_tensor

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels
    from rlserve.model.lora import LoraBatch


class ExpertParallelMoe(SparseMoe):
    """A sparse layer holding `placement.slots_per_rank` physical experts of rank `ep_rank`."""

    def __init__(self, moe: MoeShape, hidden: int, layer: int, ep_rank: int, placement: Placement):
        nn.Module.__init__(self)
        self.layer, self.top_k, self.norm_topk_prob = layer, moe.top_k, moe.norm_topk_prob
        self.num_experts, self.ep_rank, self.placement = moe.num_experts, ep_rank, placement
        s, i = placement.slots_per_rank, moe.intermediate_size
        self.gate = nn.Parameter(torch.empty(moe.num_experts, hidden))
        self.gate_up_proj = nn.Parameter(torch.empty(s, 2 * i, hidden))
        self.down_proj = nn.Parameter(torch.empty(s, hidden, i))
        self.last_experts: torch.Tensor | None = None
        self.reduce = None  # sums the slices of ranks that share the step's tokens
        self.group: Any = None  # the expert-parallel process group (set by `attach`)
        self.share = (0, 1)  # (this rank's index, ranks) among the ranks holding the same tokens
        self.eplb_interval = 0  # forwards between rebalances; 0 = never
        self.dbo = False  # dual-batch overlap
        self.forwards = 0
        # counters live on the host (built under the meta device, like the parameters, before loading)
        self.window = torch.zeros(
            moe.num_experts, dtype=torch.int64, device="cpu"
        )  # assignments since the last rebalance
        self.expert_load = torch.zeros(moe.num_experts, dtype=torch.int64, device="cpu")  # all assignments, logical ids
        self.rank_load = torch.zeros(
            placement.ep_size, dtype=torch.int64, device="cpu"
        )  # assignments each rank computed
        self.all_to_all_seconds = 0.0
        self.all_to_alls = 0
        self.rebalances = 0

    @property
    def local_slots(self) -> torch.Tensor:
        return self.placement.local(self.ep_rank)

    def forward(
        self, x: torch.Tensor, lora: LoraBatch | None = None, kernels: CpuKernels | None = None
    ) -> torch.Tensor:
        self.forwards += 1
        if self.eplb_interval and self.forwards % self.eplb_interval == 0:
            self.rebalance()
        weights, experts = self.route(x, kernels)
        self.last_experts = experts
        k, t = self.top_k, x.shape[0]
        flat = experts.view(-1)
        physical = self.placement.physical(flat, torch.arange(t, device=x.device).repeat_interleave(k))
        self._count(flat, physical)
        index, ranks = self.share
        chunk = -(-t // ranks)
        lo, hi = min(t, index * chunk), min(t, (index + 1) * chunk)
        if self.dbo:
            mid = lo + (hi - lo) // 2
            own = torch.cat(
                _overlapped(
                    self._dispatch_combine(x[a:b], weights[a:b], flat[a * k : b * k], physical[a * k : b * k], kernels)
                    for a, b in ((lo, mid), (mid, hi))
                )
            )
        else:
            own = _run(
                self._dispatch_combine(
                    x[lo:hi], weights[lo:hi], flat[lo * k : hi * k], physical[lo * k : hi * k], kernels
                )
            )
        if ranks == 1:
            return own
        out = torch.zeros_like(x)
        out[lo:hi] = own
        return self.reduce(out)

    def _dispatch_combine(self, x, weights, flat, physical, kernels) -> Generator[Any, None, torch.Tensor]:
        """One batch's dispatch, experts and combine; yields each all-to-all it starts, to be waited for
        before the generator is resumed (`_run`, `_overlapped`); returns the batch's output rows."""
        n, size, s = self.placement.ep_size, x.shape[1], self.placement.slots_per_rank
        send_order = physical.argsort(stable=True)  # by physical slot, so by destination rank
        send_slot_counts = torch.bincount(physical, minlength=n * s)
        recv_slot_counts = torch.empty_like(send_slot_counts)
        yield self._all_to_all(recv_slot_counts, send_slot_counts, [s] * n, [s] * n)
        send_counts = send_slot_counts.view(n, s).sum(1).tolist()
        recv_counts = recv_slot_counts.view(n, s).sum(1).tolist()
        rows = x.index_select(0, send_order // self.top_k)
        received = x.new_empty(sum(recv_counts), size)
        yield self._all_to_all(received, rows, recv_counts, send_counts)
        # the received rows come source by source, each source's by slot: regroup them slot by slot
        slot_of_row = torch.arange(s, device=x.device).repeat(n).repeat_interleave(recv_slot_counts)
        by_slot = slot_of_row.argsort(stable=True)
        computed = self.run_experts(
            received.index_select(0, by_slot), recv_slot_counts.view(n, s).sum(0).tolist(), kernels
        )
        results = torch.empty_like(computed).index_copy_(0, by_slot, computed)
        back = x.new_empty(rows.shape)
        yield self._all_to_all(back, results, send_counts, recv_counts)
        per_assignment = torch.empty_like(back).index_copy_(0, send_order, back)
        order = flat.argsort(stable=True)  # the one-rank layer's summation order
        out = per_assignment.index_select(0, order)
        out.mul_(weights.view(-1).index_select(0, order).unsqueeze(1))
        return combine(out, x, order // self.top_k, order, flat.view(-1, self.top_k))

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int]):
        """Starts it; the returned handle's wait() ends it and counts the seconds spent there."""
        start = time.perf_counter()
        if inp.dim() > 1 and inp.dtype != torch.uint8 and out.numel() + inp.numel():  # bytes: any dtype crosses gloo
            out, inp = out.view(torch.uint8), inp.contiguous().view(torch.uint8)
        work = self.group.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions())
        self.all_to_all_seconds += time.perf_counter() - start
        self.all_to_alls += 1
        return _Timed(work, self, (out, inp))

    def _count(self, flat: torch.Tensor, physical: torch.Tensor) -> None:
        """Load of the tokens this layer routed: every rank counts the same when ranks share tokens."""
        counts = torch.bincount(flat, minlength=self.num_experts).cpu()
        self.window += counts
        self.expert_load += counts
        self.rank_load += torch.bincount(
            physical // self.placement.slots_per_rank, minlength=self.placement.ep_size
        ).cpu()

    @torch.no_grad()
    def rebalance(self) -> None:
        """Re-place the experts for the load since the last rebalance, moving weights between ranks.
        Every rank computes the same plan from the same counts; routing (and so every token) is untouched."""
        load = self.window.clone()
        if self.share[1] < self.placement.ep_size:  # groups of ranks routed different tokens: add them up
            self.group.allreduce([load]).wait()
            load //= self.share[1]  # each group's ranks all counted its tokens
        new = rebalanced(self.placement, load)
        self.window.zero_()
        if torch.equal(new.slots, self.placement.slots):
            return
        old_gate_up, old_down = self.gate_up_proj.detach().clone(), self.down_proj.detach().clone()
        pending, buffers = [], []
        for i, (dst, slot, src, src_slot) in enumerate(transfers(self.placement, new)):
            if src == dst == self.ep_rank:
                self.gate_up_proj[slot].copy_(old_gate_up[src_slot])
                self.down_proj[slot].copy_(old_down[src_slot])
            elif src == self.ep_rank:
                packed = torch.cat((old_gate_up[src_slot].reshape(-1), old_down[src_slot].reshape(-1)))
                buffers.append(packed)
                pending.append(self.group.send([packed], dst, i))
            elif dst == self.ep_rank:
                buf = old_gate_up.new_empty(old_gate_up[0].numel() + old_down[0].numel())
                buffers.append((slot, buf))
                pending.append(self.group.recv([buf], src, i))
        for work in pending:
            work.wait()
        split = old_gate_up[0].numel()
        for item in buffers:
            if isinstance(item, tuple):
                slot, buf = item
                self.gate_up_proj[slot].copy_(buf[:split].view_as(old_gate_up[0]))
                self.down_proj[slot].copy_(buf[split:].view_as(old_down[0]))
        self.placement = new
        self.rebalances += 1


class _Timed:
    """An all-to-all in flight; waiting for it adds the time waited to its layer's all_to_all_seconds."""

    def __init__(self, work: Any, layer: ExpertParallelMoe, buffers: tuple[torch.Tensor, ...]):
        self.work, self.layer, self.buffers = work, layer, buffers  # the buffers live until the transfer ends

    def wait(self) -> None:
        start = time.perf_counter()
        self.work.wait()
        self.layer.all_to_all_seconds += time.perf_counter() - start


def _run(batch: Generator[Any, None, torch.Tensor]) -> torch.Tensor:
    """One batch: each all-to-all waited for as soon as it starts."""
    try:
        while True:
            next(batch).wait()
    except StopIteration as done:
        return done.value


def _overlapped(batches) -> list[torch.Tensor]:
    """Several batches' phases in turn: each batch's next phase (its compute included) runs while the other
    batches' all-to-alls are in flight. Every rank starts the same collectives in the same order."""
    batches = list(batches)
    pending: list[Any] = [None] * len(batches)
    outputs: list[torch.Tensor | None] = [None] * len(batches)
    while any(o is None for o in outputs):
        for i, batch in enumerate(batches):
            if outputs[i] is not None:
                continue
            if pending[i] is not None:
                pending[i].wait()
            try:
                pending[i] = next(batch)
            except StopIteration as done:
                outputs[i] = done.value
    return outputs


def convert(model: nn.Module, ep_rank: int, ep_size: int, redundant: int = 0) -> None:
    """Swap every sparse layer of a model built on the meta device for its expert-parallel form."""
    for layer in model.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoe):
            moe = model.shape.moe
            placement = Placement.initial(moe.num_experts, ep_size, redundant)
            layer.mlp = ExpertParallelMoe(moe, model.shape.hidden_size, mlp.layer, ep_rank, placement)


def expert_layers(model: nn.Module) -> list[ExpertParallelMoe]:
    return [layer.mlp for layer in model.layers if isinstance(layer.mlp, ExpertParallelMoe)]


def attach(model: nn.Module, group: Any, share: tuple[int, int], eplb_interval: int = 0, dbo: bool = False) -> None:
    """Give the sparse layers their expert-parallel group and this rank's slice of shared tokens."""
    for mlp in expert_layers(model):
        mlp.group, mlp.share, mlp.eplb_interval, mlp.dbo = group, share, eplb_interval, dbo


@torch.no_grad()
def load_expert_tensor(model: nn.Module, layer: int, suffix: str, tensor: torch.Tensor) -> bool:
    """Copy a full checkpoint expert tensor into every local slot holding that expert; False when
    `suffix` (the name after `model.layers.<layer>.`) is not an expert tensor of an expert-parallel layer."""
    mlp = model.layers[layer].mlp
    if not isinstance(mlp, ExpertParallelMoe) or not suffix.startswith("mlp.experts."):
        return False
    i = mlp.down_proj.shape[2]
    rest = suffix.removeprefix("mlp.experts.")
    for slot, expert in enumerate(mlp.local_slots.tolist()):
        if rest == "gate_up_proj":
            mlp.gate_up_proj[slot].copy_(tensor[expert])
        elif rest == "down_proj":
            mlp.down_proj[slot].copy_(tensor[expert])
        else:
            e, proj, _ = rest.split(".")
            if int(e) != expert:
                continue
            if proj == "gate_proj":
                mlp.gate_up_proj[slot, :i].copy_(tensor)
            elif proj == "up_proj":
                mlp.gate_up_proj[slot, i:].copy_(tensor)
            else:
                mlp.down_proj[slot].copy_(tensor)
    return True


def engine_part(model: nn.Module) -> tuple[int, int]:
    """(index, count) of this engine among the engines of its expert group: its tensor-parallel ranks are
    consecutive expert-parallel ranks, so each engine writes one part of a checkpoint."""
    mlp = expert_layers(model)[0]
    return mlp.ep_rank // model.tp_size, mlp.placement.ep_size // model.tp_size


def shared_names(model: nn.Module, names: Iterable[str]) -> list[str]:
    """The checkpoint tensors this engine writes besides experts: all of them without expert parallelism;
    with it, the first engine's part holds every tensor that is not an expert's (the router included)."""
    if not model.expert_parallel:
        return list(names)
    if engine_part(model)[0]:
        return []
    return [name for name in names if not is_expert_tensor(name)]


def slot_names(model: nn.Module) -> list[str]:
    """The parameters holding each expert-parallel layer's local slots (every rank's own experts, whole)."""
    return [
        f"layers.{i}.mlp.{proj}"
        for i, layer in enumerate(model.layers)
        if isinstance(layer.mlp, ExpertParallelMoe)
        for proj in ("gate_up_proj", "down_proj")
    ]


@torch.no_grad()
def primary_experts(model: nn.Module, slots: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The checkpoint tensors (copies on the CPU) of the experts whose first replica under the current placement
    lies on this engine's ranks; `slots[name]` is each of its ranks' `slot_names` parameter, in rank order.
    Every logical expert has one first replica, so the engines' parts hold each expert exactly once, however
    the load balancer replicated or moved them."""
    out = {}
    for i, layer in enumerate(model.layers):
        mlp = layer.mlp
        if not isinstance(mlp, ExpertParallelMoe):
            continue
        gate_up, down = torch.cat(slots[f"layers.{i}.mlp.gate_up_proj"]), torch.cat(slots[f"layers.{i}.mlp.down_proj"])
        first, size = mlp.ep_rank * mlp.placement.slots_per_rank, mlp.down_proj.shape[2]
        physical = mlp.placement.slots.tolist()
        for e in range(mlp.num_experts):
            j = physical.index(e) - first
            if 0 <= j < gate_up.shape[0]:
                p = f"model.layers.{i}.mlp.experts.{e}."
                out[p + "gate_proj.weight"] = gate_up[j, :size].to("cpu", copy=True)
                out[p + "up_proj.weight"] = gate_up[j, size:].to("cpu", copy=True)
                out[p + "down_proj.weight"] = down[j].to("cpu", copy=True)
    return out


def placement_key(model: nn.Module) -> int:
    """A checksum of every expert-parallel layer's placement: engines whose keys differ placed experts apart."""
    key = 0
    for mlp in expert_layers(model):
        key = zlib.crc32(mlp.placement.slots.numpy().tobytes(), key)
    return key


def expert_stats(model: nn.Module) -> dict[str, Any]:
    """What /metrics shows of expert parallelism: assignments per rank and per logical expert (all
    sparse layers), rebalances, and seconds spent in all-to-all."""
    layers = expert_layers(model)
    if not layers:
        return {}
    return {
        "ep_rank_load": [int(v) for v in sum(m.rank_load for m in layers).tolist()],
        "ep_expert_load": [int(v) for v in sum(m.expert_load for m in layers).tolist()],
        "eplb_rebalances": max(m.rebalances for m in layers),
        "ep_all_to_all_seconds": sum(m.all_to_all_seconds for m in layers),
        "ep_all_to_alls": sum(m.all_to_alls for m in layers),
    }
