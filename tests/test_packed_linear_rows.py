"""A packed projection builds a bounded set of oneDNN primitives, whatever row counts the steps bring.

oneDNN compiles and caches one primitive per input shape. Before row counts were bucketed, every distinct
number of tokens in a step made a new one: under sustained load the cache filled, churned, and the engine
core's resident memory grew by hundreds of MiB (the soak's RSS climb). The count of primitives created is
read from oneDNN's own creation log, in a fresh process."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# every row count up to 80, then every third up to 1024: without buckets, one primitive each (~400)
ROWS = [*range(1, 81), *range(81, 1025, 3), 1024]

PROBE = textwrap.dedent(
    f"""
    import torch, torch.nn.functional as F
    from rlserve.model.linear import Projection

    proj = Projection(96, 160)
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():  # as the engine steps
        if not proj.pack() or (proj(torch.randn(2, 96)) is not None and not proj.packed._onednn):
            print("NO-ONEDNN")
            raise SystemExit
        for rows in {ROWS}:
            x = torch.randn(rows, 96, generator=gen)
            out = proj(x)
            assert out.shape == (rows, 160) and out.is_contiguous(), (rows, out.shape)
            if rows % 10 in (1, 4):  # padding rows never reach the result
                assert (out - F.linear(x, proj.weight, proj.bias)).abs().max() < 1e-4, rows
    print("DONE", flush=True)
    """
)


def test_packed_projection_creates_a_bounded_set_of_onednn_primitives():
    env = {**os.environ, "ONEDNN_VERBOSE": "profile_create", "RLSERVE_DEVICE": "cpu"}
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    if "NO-ONEDNN" in done.stdout:
        pytest.skip("this torch build has no oneDNN packed fp32 linear: nothing is cached per shape")
    assert "DONE" in done.stdout
    created = [
        line
        for line in done.stdout.splitlines()
        if "create:cache_miss" in line and ",inner_product," in line and "ic96oc160" in line
    ]
    # exact up to 64 rows, then at most 8 sizes per power of two: 64 + 4 * 8 for 65..1023, and 1024
    assert len(created) <= 97, f"{len(created)} oneDNN linear primitives built for {len(ROWS)} row counts"
