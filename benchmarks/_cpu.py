"""How many CPU cores processes outside a benchmark used while it ran (OtherLoad, shared with
`rlserve bench`), and one core's instruction peaks."""

from __future__ import annotations

from rlserve.bench.machine import OtherLoad

__all__ = ["OtherLoad", "instruction_peaks"]


def instruction_peaks() -> tuple[float, float] | None:
    """One core's fp32 FMA and bf16 dot-product peaks in GFLOP/s (_peak.c), or None where there is
    no C compiler or no AVX512_BF16. Their ratio caps bf16's gain over an fp32 path that runs at
    its own peak."""
    import subprocess
    import tempfile
    from pathlib import Path

    from rlserve.model.cpu_kernels import _compiler, cpu_has_native_bf16

    cc = _compiler()  # the one the C kernels are built with
    if cc is None or not cpu_has_native_bf16():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        exe = Path(tmp) / "peak"
        built = subprocess.run(
            [cc, "-O2", str(Path(__file__).with_name("_peak.c")), "-o", str(exe)], capture_output=True, timeout=120
        )
        if built.returncode != 0:
            return None  # an AMX-only or non-x86 CPU, or a compiler without the intrinsics
        fp32, bf16 = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, check=True).stdout.split()
    return float(fp32), float(bf16)
