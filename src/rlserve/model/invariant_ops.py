"""The model's arithmetic in batch-invariant mode: every row computed the same way at any batch size.

A row's numbers must not depend on how many other rows share its step. GEMM libraries break that:
MKL and oneDNN pick kernels and blockings by the row count, and the engine itself switches from the
C GEMV to the packed GEMM above a few rows. In this mode every projection (the LM head too) runs
through one GEMM at every row count, kernels/gemm_impl.h's outer-product form: each (row, output)
pair has its own register lane that sums x[k] * w[k] in k order, whatever the tile, the row count
or the thread split. Attention runs every query token through the paged decode kernel (one online
softmax over the token's own context, in block-size steps from position 0): a prompt token is
computed as if it were decoded, so chunked prefill, prefix-cache hits and KV restored from another
tier change nothing. The element-wise C kernels are per row already.

`invariant_kernels` loads the kernels built with RLSERVE_ROW_INVARIANT (their GEMV is that GEMM;
the engine keeps its weights packed for it, `PanelWeight`, and the trainer's mirror packs per call:
the same bits), or on CUDA the Triton kernels of `triton_kernels.py` (the same interface), and
checks the row independence on the device once per process and dtype (fail closed: the mode is refused where
a row's bits would follow the batch).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
import sys
from typing import TYPE_CHECKING

import torch

from rlserve.model.cpu_kernels import (
    DTYPES,
    CpuKernels,
    _build,
    _compiler,
    _self_check,
    cpu_kernels,
)
from rlserve.model.torch_threads import one_torch_thread

if TYPE_CHECKING:
    from rlserve.model.triton_kernels import TritonKernels

log = logging.getLogger(__name__)

INVARIANT_ROWS = sys.maxsize  # the GEMV at every row count


class InvariantKernels:
    """The C kernels with the GEMV taken at any row count (the model reads `gemv_rows` to choose;
    the expert blocks read `row_invariant`)."""

    row_invariant = True

    def __init__(self, base: CpuKernels):
        self._base = base

    def __getattr__(self, name: str):
        return getattr(self._base, name)

    def gemv_rows(self, dtype: torch.dtype) -> int:
        return INVARIANT_ROWS if dtype in DTYPES else 0


def row_log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax of each row computed alone on one thread: the same bits for a row in any batch
    (the engine's prompt logprobs and the trainer's `rlserve.train` use this one formula)."""
    with one_torch_thread():
        # split, not a slice per row: one backward node for all rows (each slice's backward wrote a
        # zero tensor of the whole input: 1.6 s of a 16-sequence trainer step on SmolLM2-135M)
        return torch.cat([torch.log_softmax(row, dim=-1) for row in logits.split(1)])


class BatchInvarianceUnavailable(ValueError):
    """This machine or model cannot give bitwise batch invariance; the message says why."""


@functools.cache
def invariant_kernels(device_type: str = "cpu", dtype: torch.dtype | None = None) -> InvariantKernels | TritonKernels:
    """The kernels for batch-invariant mode on `device_type` ("cpu" or "cuda"), their row
    independence checked there for a model in `dtype` (its own and float32, an LM head's; None: every
    dtype they take); raises where not. Under TRITON_INTERPRET=1 the CPU runs the GPU's Triton kernels
    (through Triton's interpreter), where a bf16 check costs as much as a model's forwards."""
    kernels = _kernels(device_type)
    for checked in DTYPES:
        if dtype is None or checked in (dtype, torch.float32):
            _rows_checked(device_type, checked)
    return kernels


@functools.cache
def _rows_checked(device_type: str, dtype: torch.dtype) -> None:
    """A dtype's check once per process, whichever model dtype asked for it first."""
    _check_rows_independent(_kernels(device_type), dtype, torch.device(device_type))


@functools.cache
def _kernels(device_type: str) -> InvariantKernels | TritonKernels:
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        from rlserve.model.triton_kernels import triton_kernels  # imports Triton (~0.15 s): only here

        kernels = triton_kernels()
        if kernels is None:
            raise BatchInvarianceUnavailable(
                "engine.batch_invariant on a GPU needs Triton (pip install triton; PyTorch's CUDA wheels bring it)"
            )
    elif device_type == "cpu":
        base = cpu_kernels() and _row_invariant_build()
        if base is None:
            raise BatchInvarianceUnavailable(
                "engine.batch_invariant needs rlserve's CPU kernels (a C compiler, engine.cpu_kernels=true, "
                "RLSERVE_NO_CPU_KERNELS unset)"
            )
        kernels = InvariantKernels(base)
    else:
        raise BatchInvarianceUnavailable(f"engine.batch_invariant runs on CPU or CUDA, not {device_type}")
    return kernels


def _row_invariant_build() -> CpuKernels | None:
    """The kernels built with RLSERVE_ROW_INVARIANT (gemv_impl.h: the GEMV is gemm_impl.h's)."""
    try:
        kernels = CpuKernels(ctypes.CDLL(str(_build(_compiler(), ("-DRLSERVE_ROW_INVARIANT",)))))
        _self_check(kernels)
    except (OSError, subprocess.SubprocessError, AssertionError, AttributeError) as exc:
        log.warning("the batch-invariant CPU kernels are unavailable (%s)", getattr(exc, "stderr", "") or exc)
        return None
    return kernels


def _check_rows_independent(kernels, dtype: torch.dtype, device: torch.device) -> None:
    """Each row of a GEMV (packed or not) and of decode attention equals the same row computed
    alone, at every batch size and position that exercises the tile edges."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    total = 21  # past the unpacked GEMM's switch from its few-row form to packing per call (16 rows)
    for n, k in ((37, 70), (64, 33)):
        w = randn(n, k)
        panels = kernels.gemm_pack(w)
        x = randn(total, k)
        alone = torch.cat([kernels.gemv(x[i : i + 1], w) for i in range(total)])
        alone_f32 = torch.cat([kernels.gemv(x[i : i + 1], w, fp32_out=True) for i in range(total)])
        for rows in range(1, total + 1):
            for start in (0, total - rows):
                part = x[start : start + rows]
                if not (
                    torch.equal(kernels.gemv(part, w), alone[start : start + rows])
                    and torch.equal(kernels.gemv(part, w, fp32_out=True), alone_f32[start : start + rows])
                    and torch.equal(kernels.gemv(part, w, packed=panels), alone[start : start + rows])
                ):
                    raise BatchInvarianceUnavailable(
                        f"engine.batch_invariant: this {device.type} {dtype} GEMV computes a row differently at "
                        f"{rows} rows than alone; batch invariance cannot be guaranteed here"
                    )
    bs, nkv, group, d = 4, 2, 2, 16
    k_cache, v_cache = (t.contiguous() for t in randn(2, 12 * bs, nkv, d).unbind(0))
    q = randn(5, nkv * group, d)
    blocks = torch.tensor([[3, 7, 1], [5, 0, 0], [11, 2, 9], [3, 7, 1], [8, 0, 0]], device=device)
    lens = torch.tensor([10, 1, 12, 9, 3], device=device)
    alone = torch.cat([kernels.attention(q[i : i + 1], k_cache, v_cache, blocks[i : i + 1], lens[i : i + 1], bs, 0.25)
                       for i in range(5)])  # fmt: skip
    if not torch.equal(kernels.attention(q, k_cache, v_cache, blocks, lens, bs, 0.25), alone):
        raise BatchInvarianceUnavailable(
            f"engine.batch_invariant: this {device.type} {dtype} decode attention computes a row differently in a batch"
        )
    # a prompt's 40 rows over one table: tiles of consecutive positions (24 rows of 2 heads, then 16),
    # 3 chunks of keys; each row as it is alone, i.e. as the decode row at that position
    rows = 40
    q = randn(rows, nkv * group, d)
    tables = torch.tensor([[2, 9, 4, 0, 6, 1, 10, 3, 5, 7]], device=device).expand(rows, -1).contiguous()
    lens = torch.arange(1, rows + 1, device=device)
    alone = torch.cat([kernels.attention(q[i : i + 1], k_cache, v_cache, tables[i : i + 1], lens[i : i + 1], bs, 0.25)
                       for i in range(rows)])  # fmt: skip
    if not torch.equal(kernels.attention(q, k_cache, v_cache, tables, lens, bs, 0.25), alone):
        raise BatchInvarianceUnavailable(
            f"engine.batch_invariant: this {device.type} {dtype} attention computes a prompt row differently in a tile"
        )
