"""torch's intra-op threads held at one around small ops.

The C kernels run on their own pool (kernels/parallel.c). A torch op between two kernel calls that
opens an OpenMP region wakes torch's team, whose idle worker then spins for a while on the core the
pool's helper needs next: on 2 cores a decode step's embedding lookup, RoPE gather and row select
left one OpenMP thread spinning for ~10% of the process's samples (perf, 64-row decode). Ops this
small gain nothing from a second thread, so they run on one; so do the per-row ops that must give
a row the same bits in any batch."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def one_torch_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
