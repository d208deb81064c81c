"""`python -m mlx_lm.inference_server --model M --max-batch 5 ...` as rlserve flags."""

from __future__ import annotations

from rlserve.config.dialects import Flag


def _log_level(value: str) -> str:
    return value.lower()


MLX_FLAGS: dict[str, Flag] = {
    "--adapter-path": Flag("model.adapter_path"),
    "--max-batch": Flag("engine.max_num_seqs"),
    "--flush-interval-ms": Flag("engine.batch_window_ms"),
    "--max-tokens": Flag("server.generate_max_tokens"),
    "--log-level": Flag("server.log_level", convert=_log_level),
    "--metrics-format": Flag("server.metrics_format"),
}
# flags only the MLX server has: a launch line with one of them gets JSON from a plain GET /metrics
MLX_ONLY = frozenset({"--adapter-path", "--max-batch", "--flush-interval-ms", "--max-tokens"})
