"""The benchmark scripts still run (smoke runs on the tiny model; no timing is asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import cache_of_its_own

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def run(tmp_path: Path, script: str, *args: str) -> str:
    env = {**os.environ, "RLSERVE_CACHE_DIR": str(cache_of_its_own(tmp_path))}
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rate(output: str, row: str) -> float:
    match = re.search(rf"^{re.escape(row)}\s+(?:\d+\s+\d+\s+[\d.]+\s+)?([\d.]+)", output, re.M)
    assert match, f"no {row!r} row in:\n{output}"
    return float(match.group(1))


def test_throughput_quick(tmp_path):
    out = run(tmp_path, "throughput.py", "--quick", "--skip-generate-batch")
    assert rate(out, "rlserve") > 0 and rate(out, "transformers generate") > 0
    assert "prefix_cache_hits=0" in out  # fresh prompts: no run is served from an earlier one's cache


def test_prefill_quick_reports_shares_of_the_matmul_peak(tmp_path):
    out = run(tmp_path, "prefill.py", "--quick", "--dtype", "float32", "bfloat16", "--json", str(tmp_path / "p.json"))
    assert "flags:" in out and "matmul peak, float32" in out
    import json

    doc = json.loads((tmp_path / "p.json").read_text())
    rows = doc["results"]
    assert {(r["dtype"], r["prompt_len"]) for r in rows} == {(d, n) for d in ("float32", "bfloat16") for n in (16, 64)}
    assert all(r["prompt_tok_s"] > 0 and r["share_of_peak"] > 0 and r["ttft_s"] > 0 for r in rows)
    emulated = not doc["cpu"]["native_bf16"]
    assert all(r["emulated_bf16"] == (r["dtype"] == "bfloat16" and emulated) for r in rows)


def test_attention_against_a_revision_checks_the_bits_and_prints_a_ratio(tmp_path):
    out = run(tmp_path, "attention.py", "--against", "HEAD", "--rows", "4", "--context", "20", "--layers", "2",
              "--repeats", "1")  # fmt: skip
    assert "flags:" in out
    assert re.search(r"^bfloat16\s+4\s+20\s+2\s+.* GB/s .* GB/s\s+[\d.]+x$", out, re.M), out
    assert re.search(r"^float32\s+4\s+20\s+2\s+", out, re.M), out


def test_the_instruction_peak_probe_builds_and_reports_two_rates():
    """_peak.c, behind throughput.py's bf16:fp32 ceiling line: two positive GFLOP/s figures where the CPU has
    AVX512_BF16 and a C compiler, None elsewhere."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from _cpu import instruction_peaks
    finally:
        sys.path.remove(str(BENCHMARKS))
    import shutil

    peaks = instruction_peaks()
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if "avx512_bf16" in cpuinfo and shutil.which("gcc") and not os.environ.get("CC"):
        assert peaks is not None
    if peaks is not None:
        assert len(peaks) == 2 and all(p > 0 for p in peaks)


@pytest.mark.parametrize("stream", [False, True])
def test_serving_small(tmp_path, stream):
    out = run(
        tmp_path,
        "serving.py",
        "--preset",
        "tiny",
        "--clients",
        "3",
        "--new-tokens",
        "4",
        *(["--stream"] if stream else []),
    )
    assert rate(out, "rlserve engine, offline") > 0 and rate(out, "rlserve server, concurrent clients") > 0
    assert re.search(r"rlserve server, concurrent clients\s+[\d.]+\s+[\d.-]+", out)  # the others column


def test_serving_deployment_small(tmp_path):
    out = run(
        tmp_path,
        "serving.py",
        "--preset",
        "tiny",
        "--deployment",
        "--clients",
        "3",
        "--new-tokens",
        "4",
        "--latency-requests",
        "5",
    )
    assert rate(out, "1 server x 2 threads") > 0 and rate(out, "2 replicas x 1 thread, vllm-router") > 0
    assert "via router p50" in out


def test_weight_update_small(tmp_path):
    out = run(tmp_path, "weight_update.py", "--preset", "tiny", "--repeats", "1")
    assert '"update_s"' in out and '"push_s"' in out


def test_server_start_small(tmp_path, model_dir):
    out = run(tmp_path, "server_start.py", "--rounds", "1", "--model", str(model_dir))
    assert "flags:" in out
    assert re.search(r"^fork/spawn: first answer [\d.]+x the time, [\d.]+x the CPU$", out, re.M), out


def test_replica_restart_small(tmp_path, model_dir):
    out = run(tmp_path, "replica_restart.py", "--rounds", "1", "--model", str(model_dir), "--modes", "forked")
    assert re.search(r"^forked +[\d.]+ +[\d.]+ +[\d.]+$", out, re.M), out


def test_moe_quick(tmp_path):
    out = run(tmp_path, "moe.py", "--quick")
    assert rate(out, "rlserve (router replay on)") > 0 and rate(out, "transformers generate_batch") > 0
    assert "vLLM base64 .npy, int32" in out


def test_kv_offload_quick(tmp_path):
    out = run(tmp_path, "kv_offload.py", "--quick", "--disk")
    assert "same tokens: True" in out and re.search(r"^offload\s+[\d.]+", out, re.M)


def test_kv_mooncake_quick(tmp_path):
    from test_kv_mooncake import _mooncake_or_skip

    _mooncake_or_skip()
    out = run(tmp_path, "kv_mooncake.py", "--quick")
    assert "same tokens: True" in out and re.search(r"^B with the store\s+\d+", out, re.M)


def test_llamacpp_comparison_skips_the_peer_when_it_is_not_built(tmp_path):
    out = run(tmp_path, "llamacpp.py", "--preset", "tiny", "--clients", "2", "--prompt-len", "8", "--new-tokens", "4",
              "--single-new-tokens", "4", "--dtype", "bfloat16")  # fmt: skip
    assert "llama.cpp: skipped" in out
    for workload in ("64 concurrent", "batch 1"):  # the row names, whatever --clients is
        match = re.search(rf"^rlserve bfloat16\s+{workload}\s+([\d.]+)", out, re.M)
        assert match and float(match.group(1)) > 0, out


def test_ep_quick(tmp_path):
    out = run(tmp_path, "ep.py", "--quick")
    assert rate(out, "tp=1 (one rank)") > 0 and rate(out, "EP over 2 ranks") > 0
    assert rate(out, "EP over 2 ranks + dbo") > 0 and "dbo / EP:" in out
