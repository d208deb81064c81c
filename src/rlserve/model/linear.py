"""The CPU matmul paths of the model's projections: the swapped GEMM for few rows, MKL/oneDNN packed weights,
the row-invariant GEMM's panels, cast weights, and Projection (an nn.Linear that picks among them)."""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from rlserve.model.cpu_kernels import cpu_has_native_bf16

if TYPE_CHECKING:
    from rlserve.model.cpu_kernels import CpuKernels

log = logging.getLogger(__name__)

# MKL's CPU sgemm computes x @ W^T 1.3-1.9x faster for 5 to 56 rows of x when it is asked for
# (W @ x^T)^T: for the row-major x @ W^T form with few rows it picks a poor blocking (measured with
# torch 2.13's MKL on AVX-512 for every projection shape of a SmolLM2-135M; at 1-4 rows and from
# 57 rows the plain form is as fast or faster). The result is a transposed view. Only for weights
# that are not packed (see PackedWeight).
SWAPPED_GEMM_ROWS = range(5, 57)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.shape[0] in SWAPPED_GEMM_ROWS:
        out = torch.mm(weight, x.t()).t()
        return out if bias is None else out + bias
    if x.device.type == "cpu" and x.dtype == torch.bfloat16 and not cpu_has_native_bf16():
        # emulated bf16 GEMMs are several times slower than widening both sides to fp32 (see PackedWeight)
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def weight_key(weight: torch.Tensor) -> tuple[int, int]:
    """What a derived copy of a weight is keyed by: its storage and its version counter, which
    in-place updates (weight pushes, optimizer steps) bump."""
    return weight.data_ptr(), weight._version


# oneDNN builds (JIT-compiles) one primitive per input shape and caches up to 1024 of them. Fed every
# row count a step can have, the cache fills and churns, and the engine's resident memory climbed by
# hundreds of MiB under load (primitives, and the heap they fragment). Row counts past this run at one
# of 8 sizes per power of two instead (at most 1/8 padding rows): a bounded set of primitives, reused.
ONEDNN_EXACT_ROWS = 64


def onednn_rows(rows: int) -> int:
    """The row count a oneDNN packed linear runs `rows` rows at (padded with zero rows, then sliced)."""
    if rows <= ONEDNN_EXACT_ROWS:
        return rows
    step = 1 << (rows.bit_length() - 4)
    return -(-rows // step) * step


class PackedWeight:
    """A CPU weight kept a second time in its GEMM library's packed layout: oneDNN's blocked layout
    (`mkldnn._reorder_linear_weight`) for bf16 and, where oneDNN is there, for fp32; else fp32 in
    MKL's (`cblas_sgemm_pack`).

    Plain sgemm repacks the whole weight on every call; at decode batch sizes that pass costs as
    much as the multiply. Packed once, the SmolLM2-135M projections run 1.3-2.3x faster at 4-64
    rows and as fast at 1-3 (2 cores, AVX-512), the vocabulary projection 1.5x at 64 rows; bf16
    through oneDNN's packed weight 1.2-2x faster than bf16 `F.linear` (AVX512_BF16), with the same
    bits. fp32 through oneDNN: 2.0x MKL's packed sgemm at 64 rows, 1.3-2.6x from 9 to 512 rows (2
    cores of an AMD EPYC with AVX-512, the projections of SmolLM2-135M; strict fp32, no bf16 inside).
    The copy costs one more weight's memory. It is rebuilt when the weight changes in place (weight
    updates bump its version counter) or is replaced.

    bf16 on a CPU without native bf16 (no AVX512_BF16/AMX): the copy is fp32 and the arithmetic
    fp32 (`widens`), the output rounded to bf16 as a bf16 GEMM's fp32 sums are: emulated bf16 GEMMs
    ran at 3.5 GFLOP/s where fp32 ran at 100+ (2 cores, AVX2), and a bf16 value widens to fp32
    exactly. The copy then costs twice the bf16 weight's memory."""

    def __init__(self) -> None:
        self._packed: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None
        self._onednn = False  # the library that packed it, and so the one that multiplies with it

    @staticmethod
    def supported(weight: torch.Tensor) -> bool:
        if weight.device.type != "cpu":
            return False
        if weight.dtype == torch.bfloat16:
            return PackedWeight.widens(weight) or _onednn_packing_works(torch.bfloat16)
        return weight.dtype == torch.float32 and _fp32_packing_works()

    @staticmethod
    def widens(weight: torch.Tensor) -> bool:
        """Whether a bf16 weight is packed as fp32 and multiplied in fp32 (no native bf16 here)."""
        return weight.dtype == torch.bfloat16 and not cpu_has_native_bf16() and _onednn_packing_works(torch.float32)

    @staticmethod
    def packed_bytes(weight: torch.Tensor) -> int:
        return weight.numel() * (4 if PackedWeight.widens(weight) else weight.element_size())

    def refresh(self, weight: torch.Tensor) -> None:
        """Repack if the weight changed since the last pack (~0.15 s for a 135M model's weights)."""
        key = weight_key(weight)
        if key != self._key:
            source = weight.detach().float() if self.widens(weight) else weight.detach()
            self._onednn = source.dtype == torch.bfloat16 or _onednn_packing_works(torch.float32)
            if self._onednn:
                self._packed = torch.ops.mkldnn._reorder_linear_weight(source, 64)
            else:
                self._packed = torch.ops.mkl._mkl_reorder_linear_weight(source, 64)
            self._key = key

    def forget(self) -> None:
        """Drop the packed copy (its weight's memory was released); the next refresh packs anew."""
        self._packed, self._key = None, None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        self.refresh(weight)
        if x.dtype != self._packed.dtype:  # a widened bf16 weight (oneDNN): fp32 in, bf16 out
            out = self._linear(x.float(), weight, None if bias is None else bias.float())
            return out.to(x.dtype)
        return self._linear(x, weight, bias)

    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self._onednn:
            rows = x.shape[0]
            padded = onednn_rows(rows)
            if padded == rows:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")
            x = F.pad(x, (0, 0, 0, padded - rows))
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, bias, "none", [], "")[:rows]
        # the op uses the packed weight only when told the real row count; else it falls back
        return torch.ops.mkl._mkl_linear(x, self._packed, weight, bias, x.shape[0])


def _fp32_packing_works() -> bool:
    return _onednn_packing_works(torch.float32) or _mkl_packing_works()


@functools.cache
def _mkl_packing_works() -> bool:
    """MKL documents a packed matrix for the row count it was packed with; rlserve reuses one for
    every row count, which holds for the layouts MKL uses (B panels do not depend on M). Checked
    once per process against plain sgemm, so a build where it does not hold falls back."""
    if not (torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")):
        return False
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 200, generator=gen), torch.randn(300, generator=gen)
    packed = PackedWeight()
    for rows in (1, 3, 17, 64, 200):
        x = torch.randn(rows, 200, generator=gen)
        if not torch.allclose(packed.linear(x, weight, bias), F.linear(x, weight, bias), atol=1e-4):
            log.warning("MKL packed sgemm disagrees with sgemm at %d rows; projections stay unpacked", rows)
            return False
    return True


@functools.cache
def _onednn_packing_works(dtype: torch.dtype) -> bool:
    """oneDNN's packed linear in `dtype`, checked once per process against `F.linear` (bf16: the
    same bits expected; fp32: fp32 rounding, no bf16 inside); a build where it differs or lacks the
    ops keeps MKL (fp32) or plain `F.linear` (bf16)."""
    if not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(300, 200, generator=gen).to(dtype), torch.randn(300, generator=gen).to(dtype)
    atol = 0.25 if dtype == torch.bfloat16 else 1e-4
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        for rows in (1, 3, 17, 64, 200):
            x = torch.randn(rows, 200, generator=gen).to(dtype)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
            if not torch.allclose(got.float(), F.linear(x, weight, bias).float(), atol=atol):
                log.warning("oneDNN packed %s linear disagrees with F.linear at %d rows; not using it", dtype, rows)
                return False
    except (RuntimeError, AttributeError) as exc:
        log.warning("oneDNN packed %s linear is unavailable (%s); not using it", dtype, exc)
        return False
    return True


class CastWeight:
    """A copy of a weight in another dtype (the fp32 LM head of a bf16 model), kept in one buffer
    and refreshed in place when the weight changes, so a packed copy of it sees the change too."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self._copy: torch.Tensor | None = None
        self._key: tuple[int, int] | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = weight_key(weight)
        if key != self._key:
            if self._copy is None or self._copy.shape != weight.shape or self._copy.device != weight.device:
                self._copy = weight.detach().to(self.dtype)
            else:
                self._copy.copy_(weight.detach())
            self._key = key
        return self._copy

    def forget(self) -> None:
        self._copy, self._key = None, None


class PanelWeight:
    """A CPU weight kept a second time in the row-invariant GEMM's panels (`CpuKernels.gemm_pack`,
    kernels/gemm_impl.h): the same sums as packing it on every call, without that pass. Packed once,
    it ran the SmolLM2-135M projections (weights streamed from memory, 2 cores, AVX-512) 1.1-1.2x
    faster than the GEMV and oneDNN's packed weights from 1 to 128 rows, fp32 and bf16. Repacked in
    its own buffer when the weight changes in place (its version counter) or is replaced."""

    def __init__(self, kernels: CpuKernels, buffer: torch.Tensor | None = None) -> None:
        self.kernels = kernels
        self._packed: torch.Tensor | None = buffer  # where to pack (`gemm_pack` reuses it when its size fits)
        self._key: tuple[int, int] | None = None

    def get(self, weight: torch.Tensor) -> torch.Tensor:
        key = weight_key(weight)
        if key != self._key:
            self._packed = self.kernels.gemm_pack(weight.detach(), out=self._packed)
            self._key = key
        return self._packed

    def forget(self) -> None:
        self._packed, self._key = None, None


class PanelSet:
    """The panels of many projections, brought up to date together before each step that reads them
    (`CausalLM`'s one-call decode). Their weights are read straight from each module's parameter
    dict: through `nn.Module.__getattr__`, the same check over 30 layers' 120 projections took
    ~0.6 ms a step, 5% of a batch-1 bf16 decode step."""

    def __init__(self, projections: list[Projection]) -> None:
        self._items = [(m._parameters, m.panels) for m in projections if m.panels is not None]

    def refresh(self) -> None:
        """Repack each panel whose weight changed in place or was replaced since it was packed."""
        for params, panels in self._items:
            weight = params["weight"]
            if (weight.data_ptr(), weight._version) != panels._key:
                panels.get(weight)


class Projection(nn.Linear):
    """nn.Linear that runs through a packed copy of its weight once `pack()` has made one, and
    through the C GEMV for a few rows once `CausalLM.use_gemv` has given it the kernels."""

    packed: PackedWeight | None = None
    gemv: CpuKernels | None = None
    panels: PanelWeight | None = None  # the C GEMM's packed weight, at any row count (`CausalLM.pack_panels`)

    def pack(self) -> bool:
        self.packed = PackedWeight() if PackedWeight.supported(self.weight) else None
        return self.packed is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.panels is not None and x.dtype == self.weight.dtype:  # at any row count
            return self.gemv.gemv(x, self.weight, self.bias, packed=self.panels.get(self.weight))
        if self.gemv is not None and x.shape[0] <= self.gemv.gemv_rows(x.dtype) and x.dtype == self.weight.dtype:
            return self.gemv.gemv(x, self.weight, self.bias)
        if self.packed is not None:
            return self.packed.linear(x, self.weight, self.bias)
        return linear(x, self.weight, self.bias)
