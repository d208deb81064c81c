"""Cross-replica prefix reuse through one Mooncake store (kv_cache_offload.type = "mooncake").

A real mooncake_master on 127.0.0.1 and two engines in this process, as two replicas: replica A serves P
prompts of L tokens (greedy, G generated), then fillers that cycle its whole pool, so every prompt block is
evicted into the store; replica B, which never saw the prompts, then serves them. The same prompts go to a
third engine without the store (a replica that computes everything). Reported: prompt tokens computed by
B with and without the store, B's prefill time, the store's load time per block, and whether the tokens
are the same.

    python benchmarks/kv_mooncake.py [--preset smollm2-135m] [--prompts 16] [--prompt-tokens 512]
    python benchmarks/kv_mooncake.py --quick      # smoke run: tiny model, 4 prompts of 64 tokens
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from transformers import AutoConfig

from rlserve.config.schema import Config, KVOffloadConfig
from rlserve.deploy.mooncake import MooncakeMaster
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.llama import ModelShape
from rlserve.model.make import bench_cache_dir, make_model


def make_engine(model_dir, args, pool_tokens: int, master: MooncakeMaster | None) -> Engine:
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = args.prompt_tokens + args.gen_tokens + args.block_size
    cfg.engine.block_size = args.block_size
    cfg.engine.enable_prefix_caching = True
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))
    cfg.engine.kv_cache_bytes = pool_tokens * shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4  # fp32
    if master is not None:
        cfg.kv_cache_offload = KVOffloadConfig.model_validate(
            {
                "type": "mooncake",
                "cpu": {"num_bytes": args.store_mib << 20},
                "mooncake": {"master_address": master.master_address, "metadata_server": master.metadata_server},
            }
        )
    engine = Engine(cfg)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    return engine


def serve(engine: Engine, prompts: list[list[int]], gen_tokens: int) -> tuple[list, int, float]:
    """Tokens generated, prompt tokens computed, seconds (one prompt at a time: each one's prefill stands alone)."""
    params = SamplingParams(temperature=0, max_tokens=gen_tokens, ignore_eos=True)
    before, start = engine.stats.prompt_tokens_computed, time.perf_counter()
    tokens = [engine.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    return tokens, engine.stats.prompt_tokens_computed - before, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--gen-tokens", type=int, default=1, help="1: the time is about the prefill")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--store-mib", type=int, default=256, help="DRAM each replica contributes to the store")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.preset, args.prompts, args.prompt_tokens, args.store_mib = "tiny", 4, 64, 32
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    rng = random.Random(0)
    prompts = [[rng.randrange(250) for _ in range(args.prompt_tokens)] for _ in range(args.prompts)]
    pool_tokens = 2 * (args.prompt_tokens + args.gen_tokens + args.block_size)
    fillers = [[rng.randrange(250) for _ in range(args.prompt_tokens)] for _ in range(3)]
    print(
        f"{args.preset}: {args.prompts} prompts x {args.prompt_tokens} tokens, {args.gen_tokens} generated, "
        f"block {args.block_size}, pool {pool_tokens} tokens a replica, store {args.store_mib} MiB a replica"
    )
    master = MooncakeMaster()
    try:
        a = make_engine(model_dir, args, pool_tokens, master)
        b = make_engine(model_dir, args, pool_tokens, master)
        alone = make_engine(model_dir, args, pool_tokens, None)
        tokens_a, computed_a, seconds_a = serve(a, prompts, args.gen_tokens)
        serve(a, fillers, 1)  # every prompt block leaves A's pool for the store
        tokens_b, computed_b, seconds_b = serve(b, prompts, args.gen_tokens)
        tokens_alone, computed_alone, seconds_alone = serve(alone, prompts, args.gen_tokens)
        sa, sb = a.stats, b.stats
        blocks = sb.kv_offload_mooncake_hits // args.block_size
        block_bytes = sb.kv_offload_bytes_from_mooncake / max(blocks, 1)
        total = args.prompts * args.prompt_tokens
        print(f"\n{'replica':<28}{'prompt tok computed':>20}{'of':>8}{'seconds':>9}")
        print(f"{'A (computes, then evicts)':<28}{computed_a:>20}{total:>8}{seconds_a:>9.2f}")
        print(f"{'B with the store':<28}{computed_b:>20}{total:>8}{seconds_b:>9.2f}")
        print(f"{'B without the store':<28}{computed_alone:>20}{total:>8}{seconds_alone:>9.2f}")
        print(
            f"\nstore: A put {sa.kv_offload_bytes_to_mooncake / 2**20:.1f} MiB "
            f"({sa.kv_offload_mooncake_put_skipped} blocks skipped), B loaded {blocks} blocks of "
            f"{block_bytes / 1024:.1f} KiB ({sb.kv_offload_bytes_from_mooncake / 2**20:.1f} MiB), "
            f"{sb.kv_offload_mooncake_rejected} rejected"
        )
        if blocks:
            per_block = sb.kv_offload_mooncake_load_seconds / blocks
            print(
                f"load time per block: {per_block * 1e3:.3f} ms ({block_bytes / per_block / 2**20:.0f} MiB/s, "
                "get + checksum + copy into the pool)"
            )
        print(f"prefill time B with/without the store: x{seconds_alone / seconds_b:.2f} faster")
        print(f"same tokens: {tokens_b == tokens_alone == tokens_a}")
        for e in (a, b, alone):
            e.close()
    finally:
        master.stop()


if __name__ == "__main__":
    main()
