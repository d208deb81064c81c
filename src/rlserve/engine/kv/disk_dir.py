"""A process's own directory under kv_cache_offload.disk.path. The native disk tier keeps its block files in one
and the Mooncake master rlserve starts keeps its storage root in another; both are made here, after the checks
that the path exists and is writable, each failing with a ValueError that says what to fix."""

from __future__ import annotations

import tempfile
from pathlib import Path


def make_private_dir(root: str, prefix: str) -> Path:
    """A fresh directory under `root` (kv_cache_offload.disk.path), named `prefix` + a random suffix."""
    base = Path(root)
    if not base.is_dir():
        raise ValueError(f"kv_cache_offload.disk.path {root!r} is not an existing directory: create it or fix the path")
    try:
        made = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        (made / "probe").write_bytes(b"x")
        (made / "probe").unlink()
    except OSError as e:
        raise ValueError(f"kv_cache_offload.disk.path {root!r} is not writable ({e}): fix its permissions") from None
    return made
