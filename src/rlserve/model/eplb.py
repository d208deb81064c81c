"""Where each expert lives under expert parallelism (Placement: physical slot -> logical expert), and the
load balancer's plan: how many replicas each expert gets, which ranks hold them, and which weights move.

Plans are pure functions of the placement and the measured load, so every rank computes the same plan
without talking. A rank holds `slots_per_rank` slots; with `redundant` extra slots in all (vLLM's
num_redundant_experts), the hottest experts get more than one replica.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    slots: torch.Tensor  # [ep_size * slots_per_rank] logical expert of each physical slot
    num_experts: int
    ep_size: int

    @property
    def slots_per_rank(self) -> int:
        return self.slots.numel() // self.ep_size

    @classmethod
    def initial(cls, num_experts: int, ep_size: int, redundant: int = 0) -> Placement:
        """Experts in order, E/N to a rank; redundant slots hold second copies of experts 0, 1, ..."""
        total = num_experts + redundant
        if total % ep_size:
            raise ValueError(
                f"expert parallelism over {ep_size} ranks needs the experts ({num_experts}) plus the redundant "
                f"experts ({redundant}) to divide evenly: pick a tp * dp (or num_redundant_experts) that does"
            )
        return cls(torch.arange(total, device="cpu") % num_experts, num_experts, ep_size)

    def local(self, rank: int) -> torch.Tensor:
        s = self.slots_per_rank
        return self.slots[rank * s : (rank + 1) * s]

    @functools.cached_property
    def replica_table(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([experts, most replicas] physical slots, padded by repeating; [experts] replica counts)."""
        replicas = [torch.nonzero(self.slots == e).view(-1) for e in range(self.num_experts)]
        width = max(r.numel() for r in replicas)
        table = torch.stack([r.repeat(-(-width // r.numel()))[:width] for r in replicas])
        return table, torch.tensor([r.numel() for r in replicas], device="cpu")

    def physical(self, experts: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The physical slot serving each (token, logical expert) assignment: replica `token % replicas`."""
        table, counts = (t.to(experts.device) for t in self.replica_table)
        if table.shape[1] == 1:
            return table[:, 0].index_select(0, experts)
        return table[experts, tokens % counts.index_select(0, experts)]


def rebalanced(placement: Placement, load: torch.Tensor) -> Placement:
    """A placement for `load` (assignments per logical expert): replicas to the experts with the most load
    per replica, then replicas heaviest first onto the least loaded rank with a free slot (one that does
    not hold the expert yet, where there is one). A rank keeps an expert in the slot it had, so only the
    experts that change rank move."""
    n, s, e_count = placement.ep_size, placement.slots_per_rank, placement.num_experts
    load = load.double().tolist()
    replicas = [1] * e_count
    for _ in range(n * s - e_count):  # at most one replica a rank while any expert has fewer
        open_ = [e for e in range(e_count) if replicas[e] < n] or range(e_count)
        hot = max(open_, key=lambda e: (load[e] / replicas[e], -e))
        replicas[hot] += 1
    items = sorted(
        ((load[e] / replicas[e], e) for e in range(e_count) for _ in range(replicas[e])), key=lambda x: (-x[0], x[1])
    )
    rank_load, held = [0.0] * n, [[] for _ in range(n)]
    for share, e in items:
        free = [r for r in range(n) if len(held[r]) < s]
        fresh = [r for r in free if e not in held[r]] or free
        r = min(fresh, key=lambda r: (rank_load[r], r))
        held[r].append(e)
        rank_load[r] += share
    slots = []
    for r in range(n):
        old = placement.local(r).tolist()
        keep = list(held[r])
        row: list[int | None] = []
        for e in old:  # an expert the rank keeps stays in its slot
            if e in keep:
                keep.remove(e)
                row.append(e)
            else:
                row.append(None)
        slots += [e if e is not None else keep.pop(0) for e in row]
    return Placement(torch.tensor(slots, device="cpu"), e_count, n)


def transfers(old: Placement, new: Placement) -> list[tuple[int, int, int, int]]:
    """(dst rank, dst slot, src rank, src slot) for every slot whose expert changes: from the rank's own
    old slots when it held the expert, else from the first rank that held it."""
    s, out = old.slots_per_rank, []
    old_slots = old.slots.tolist()
    for p, (was, now) in enumerate(zip(old_slots, new.slots.tolist())):
        if was == now:
            continue
        dst, slot = divmod(p, s)
        local = old_slots[dst * s : (dst + 1) * s]
        src_p = dst * s + local.index(now) if now in local else old_slots.index(now)
        out.append((dst, slot, *divmod(src_p, s)))
    return out


def busiest_share(rank_load: torch.Tensor) -> float:
    """The busiest rank's fraction of all assignments (1/N is perfectly balanced)."""
    total = float(rank_load.sum())
    return float(rank_load.max()) / total if total else 0.0
