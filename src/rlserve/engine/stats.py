"""What an engine reports about itself (EngineStats): queue, KV cache, prefix cache, offload and transfer counters.
The server's /metrics and /load read it; it crosses the engine process wire as its fields."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

# vLLM's vllm:iteration_tokens_total bounds: tokens per engine step
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


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
    # per ITERATION_TOKENS_BUCKETS bound then +Inf: steps with that many tokens (not cumulative); their token sum
    iteration_tokens: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
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
    # expert parallelism (model/expert_parallel.py): assignments each rank computed, per logical expert
    ep_rank_load: list[int] = field(default_factory=list)
    ep_expert_load: list[int] = field(default_factory=list)
    eplb_rebalances: int = 0
    ep_all_to_all_seconds: float = 0.0  # rank 0's time in the dispatch and combine all-to-alls
    ep_all_to_alls: int = 0  # rank 0's all-to-alls (three per sparse layer and batch; enable_dbo: two batches)


def engine_stats(engine: Any) -> EngineStats:
    """An Engine's counters and gauges now: its scheduler's, pool's, offload tier's and KV transfer's."""
    from rlserve.model.expert_parallel import expert_stats  # the model's code stays out of the server's imports

    s = engine.scheduler.stats
    return EngineStats(
        num_running=len(engine.scheduler.running),
        num_waiting=len(engine.scheduler.waiting),
        kv_cache_usage=engine.pool.usage,
        num_blocks=engine.pool.num_blocks,
        block_size=engine.pool.block_size,
        num_preemptions=s.num_preemptions,
        prefix_cache_queries=s.prefix_cache_queries,
        prefix_cache_hits=s.prefix_cache_hits,
        prompt_tokens_computed=s.prompt_tokens_computed,
        num_steps=s.num_steps,
        iteration_tokens=list(s.iteration_tokens),
        iteration_tokens_sum=s.iteration_tokens_sum,
        generation_tokens=engine.generation_tokens,
        policy_version=engine.policy_version,
        **(_offload_stats(engine.offload) if engine.offload is not None else {}),
        **(_transfer_stats(engine.kv_transfer) if engine.kv_transfer is not None else {}),
        **expert_stats(engine.model),
    )


def _transfer_stats(t: Any) -> dict[str, float]:
    return {f"kv_transfer_{k}": v for k, v in asdict(t.stats).items()} | {"kv_transfer_pinned_blocks": t.pinned_blocks}


def _offload_stats(o: Any) -> dict[str, int]:
    usage = {
        "cpu_used_bytes": o.cpu_used_bytes,
        "cpu_capacity_bytes": o.cpu_capacity_bytes,
        "disk_used_bytes": o.disk.used_bytes if o.disk is not None else 0,
    }
    return {f"kv_offload_{k}": v for k, v in (asdict(o.stats) | usage).items()}
