"""What an engine reports about itself (EngineStats): queue, KV cache, prefix cache, offload and transfer counters.
The server's /metrics and /load read it; it crosses the engine process wire as its fields."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_blocks: int
    block_size: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_computed: int
    generation_tokens: int
    policy_version: int
    num_steps: int = 0  # engine steps that ran a batch
    # KV offload tiers (0 without them); *_queries/*_hits count prompt tokens
    kv_offload_cpu_queries: int = 0
    kv_offload_cpu_hits: int = 0
    kv_offload_disk_queries: int = 0
    kv_offload_disk_hits: int = 0
    kv_offload_disk_rejected: int = 0  # disk blocks that failed their checksum (recomputed)
    kv_offload_bytes_to_cpu: int = 0
    kv_offload_bytes_from_cpu: int = 0
    kv_offload_bytes_to_disk: int = 0
    kv_offload_bytes_from_disk: int = 0
    kv_offload_cpu_used_bytes: int = 0
    kv_offload_cpu_capacity_bytes: int = 0
    kv_offload_disk_used_bytes: int = 0
    # kv_cache_offload.type = "mooncake" (engine/kv/mooncake.py MooncakeStats)
    kv_offload_mooncake_queries: int = 0
    kv_offload_mooncake_hits: int = 0
    kv_offload_mooncake_rejected: int = 0
    kv_offload_mooncake_put_skipped: int = 0
    kv_offload_bytes_to_mooncake: int = 0
    kv_offload_bytes_from_mooncake: int = 0
    kv_offload_mooncake_load_seconds: float = 0.0
    # prefill/decode KV transfer (0 without kv_transfer); see engine/kv/transfer.py TransferStats
    kv_transfer_pulls: int = 0
    kv_transfer_pull_failures: int = 0
    kv_transfer_fallbacks: int = 0
    kv_transfer_skipped: int = 0
    kv_transfer_bytes_in: int = 0
    kv_transfer_seconds_in: float = 0.0
    kv_transfer_tokens_in: int = 0
    kv_transfer_serves: int = 0
    kv_transfer_bytes_out: int = 0
    kv_transfer_seconds_out: float = 0.0
    kv_transfer_pinned: int = 0
    kv_transfer_expired: int = 0
    kv_transfer_pinned_blocks: int = 0
