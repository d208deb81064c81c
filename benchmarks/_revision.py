"""The CPU kernels as another git revision had them, built with the package's flags, for benchmarks
that alternate two builds in one process (gemm.py, attention.py)."""

from __future__ import annotations

import io
import subprocess
import tarfile
from pathlib import Path

from rlserve.model.cpu_kernels import KERNEL_DIR, _compiler, compile_kernels

REPO = Path(__file__).resolve().parents[1]


def build_at(rev: str, out_dir: Path) -> Path:
    """The kernels' library as `rev` had them, built with the flags the package uses."""
    kernels = KERNEL_DIR.relative_to(REPO).as_posix()
    tar = subprocess.run(["git", "-C", str(REPO), "archive", rev, kernels], capture_output=True, check=True).stdout
    tarfile.open(fileobj=io.BytesIO(tar)).extractall(out_dir, filter="data")
    lib = out_dir / f"kernels-{rev.replace('/', '_')}.so"
    compile_kernels(_compiler(), sorted((out_dir / kernels).glob("*.c")), lib)
    return lib
