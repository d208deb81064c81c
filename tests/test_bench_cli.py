"""`rlserve bench`: against a real server (table, JSON, a PNG that decodes) and the offline engine."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SMALL = ["--prompt-len", "8", "--output-len", "4", "--no-progress"]


def bench(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlserve.cli", "bench", *args], capture_output=True, text=True, timeout=timeout
    )


def check_outputs(out: subprocess.CompletedProcess, json_path, png_path) -> dict:
    assert out.returncode == 0, out.stderr[-2000:]
    assert "out tok/s" in out.stdout and "TTFT p99 ms" in out.stdout and "ITL p50 ms" in out.stdout
    assert png_path.read_bytes()[:8] == PNG_SIGNATURE
    height, width, _ = matplotlib.image.imread(png_path).shape  # decodes
    assert height > 100 and width > 100
    return json.loads(json_path.read_text())


def test_bench_serve_against_a_real_server(server, tmp_path):
    json_path, png_path = tmp_path / "serve.json", tmp_path / "serve.png"
    out = bench("serve", "--base-url", server, "--concurrency", "1", "3", "--num-prompts", "3", *SMALL,
                "--json", str(json_path), "--plot", str(png_path))  # fmt: skip
    result = check_outputs(out, json_path, png_path)
    assert result["kind"] == "serve" and result["stream"] is True
    assert [r["concurrency"] for r in result["runs"]] == [1, 3]
    for run in result["runs"]:
        assert run["requests"] == 3 and run["failed"] == 0
        assert run["output_tokens"] == 3 * 4  # EOS ignored: every request runs to output_len
        assert run["output_tokens_per_s"] > 0 and run["requests_per_s"] > 0
        assert run["ttft_ms"]["p50"] <= run["latency_ms"]["p99"]
        assert set(run["itl_ms"]) == {"mean", "p50", "p90", "p99"}


def test_bench_serve_without_streaming_has_no_token_latencies(server, tmp_path):
    json_path = tmp_path / "serve.json"
    out = bench("serve", "--base-url", server, "--concurrency", "2", "--num-prompts", "2", "--no-stream", *SMALL,
                "--json", str(json_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    run = json.loads(json_path.read_text())["runs"][0]
    assert run["output_tokens"] == 2 * 4 and run["ttft_ms"] is None and run["latency_ms"]["p50"] > 0


def test_bench_serve_reports_a_server_it_cannot_reach(tmp_path):
    out = bench("serve", "--base-url", "http://127.0.0.1:9", "--concurrency", "1", "--num-prompts", "1", *SMALL,
                "--model", "m", "--no-warmup", "--json", str(tmp_path / "r.json"))  # fmt: skip
    assert out.returncode == 1
    run = json.loads((tmp_path / "r.json").read_text())["runs"][0]
    assert run["failed"] == 1 and "Cannot connect to host 127.0.0.1:9" in run["errors"][0]


def test_bench_throughput_runs_the_offline_engine(tmp_path):
    json_path, png_path = tmp_path / "t.json", tmp_path / "t.png"
    out = bench("throughput", "--num-prompts", "2", "--n", "2", *SMALL, "--json", str(json_path), "--plot", str(png_path),
                "--model.max_model_len", "128", "--engine.kv_cache_bytes", str(8 << 20))  # fmt: skip
    result = check_outputs(out, json_path, png_path)
    assert result["kind"] == "throughput" and result["dtype"] == "float32"
    run = result["runs"][0]
    assert run["output_tokens"] == 2 * 2 * 4 and run["failed"] == 0
