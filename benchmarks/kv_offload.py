"""Multi-turn sessions whose cached working set is ~4x the KV pool, with and without KV offload, in one run.

S sessions x T turns; turn t sends every session's history (H tokens + t x N new ones) at once and
generates G tokens (greedy, EOS ignored). The pool holds a quarter of the sessions' final histories,
so without offload a session's blocks are evicted before its next turn and it re-prefills them; with
offload (a CPU tier sized for the working set) they are loaded back. Same engine, model, prompts.

    python benchmarks/kv_offload.py [--preset smollm2-135m] [--sessions 32] [--turns 6]
    python benchmarks/kv_offload.py --quick      # smoke run: tiny model, 4 sessions x 2 turns
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import tempfile
import time

import torch
from transformers import AutoConfig

from _cpu import OtherLoad
from rlserve.config.schema import Config, KVOffloadConfig
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model
from rlserve.model.shape import ModelShape


def run(model_dir, args, offload: dict | None) -> dict:
    final = args.history + args.turns * args.new_tokens
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = final + args.gen_tokens + args.block_size
    cfg.engine.block_size = args.block_size
    shape = ModelShape.from_hf(AutoConfig.from_pretrained(model_dir))
    per_token = shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * 4  # fp32, the CPU default
    bs = args.block_size
    pool_tokens = -(-max(args.sessions * final // 4, cfg.model.max_model_len) // bs) * bs
    cfg.engine.kv_cache_bytes = pool_tokens * per_token
    if offload is not None:
        offload["cpu"]["num_bytes"] = int(1.25 * args.sessions * (final + args.gen_tokens) * per_token)
        cfg.kv_cache_offload = KVOffloadConfig.model_validate(offload)
    engine = Engine(cfg)
    engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    rng = random.Random(0)
    convs = [[rng.randrange(engine.vocab_size) for _ in range(final)] for _ in range(args.sessions)]
    params = SamplingParams(temperature=0, max_tokens=args.gen_tokens, ignore_eos=True)
    ttft, computed, generated, tokens = [], [], 0, []
    with OtherLoad() as load:
        start = time.perf_counter()
        for t in range(args.turns):
            before = engine.stats.prompt_tokens_computed
            reqs = [
                engine.make_request(f"s{i}-t{t}", c[: args.history + (t + 1) * args.new_tokens], params)
                for i, c in enumerate(convs)
            ]
            for req in reqs:
                engine.submit(req)
            while engine.has_unfinished():
                engine.step_requests()
            ttft.append(statistics.median(r.first_token_time - r.arrival_time for r in reqs))
            computed.append(engine.stats.prompt_tokens_computed - before)
            generated += sum(len(r.seqs[0].output_token_ids) for r in reqs)
            tokens.append([r.seqs[0].output_token_ids for r in reqs])
            print(
                f"  {'offload' if offload else 'no offload'} turn {t + 1}: {computed[-1]} prompt tokens computed, "
                f"median TTFT {ttft[-1]:.2f} s",
                flush=True,
            )
        elapsed = time.perf_counter() - start
    s = engine.stats
    engine.close()
    return {
        "tok/s": generated / elapsed,
        "seconds": elapsed,
        "ttft": ttft,
        "computed": computed,
        "tokens": tokens,
        "moved": (
            s.kv_offload_bytes_to_cpu,
            s.kv_offload_bytes_from_cpu,
            s.kv_offload_bytes_to_disk,
            s.kv_offload_bytes_from_disk,
        ),
        "hits": (s.prefix_cache_hits, s.kv_offload_cpu_hits, s.kv_offload_disk_hits),
        "pool_blocks": s.num_blocks,
        "others": load.cores,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--history", type=int, default=512, help="tokens before the first turn's new ones")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens each turn adds")
    p.add_argument("--gen-tokens", type=int, default=16, help="tokens generated a turn")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--disk", action="store_true", help="also a disk tier (in a temporary folder)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.preset, args.sessions, args.turns, args.history, args.new_tokens, args.gen_tokens = "tiny", 4, 2, 32, 16, 2
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    final = args.history + args.turns * args.new_tokens
    print(
        f"{args.preset}: {args.sessions} sessions x {args.turns} turns, history {args.history} + "
        f"{args.new_tokens}/turn (final {final}), {args.gen_tokens} generated/turn, pool = 1/4 of the working set"
    )
    results = {}
    with tempfile.TemporaryDirectory(prefix="rlserve-bench-kv-") as disk:
        for name, offload in (
            ("no offload", None),
            ("offload", {"cpu": {}, **({"disk": {"path": disk}} if args.disk else {})}),
        ):
            results[name] = run(model_dir, args, offload)
            gc.collect()
    base, off = results["no offload"], results["offload"]
    print(f"\n{'run':<12}{'tok/s':>8}{'seconds':>9}{'median TTFT s':>15}{'prompt tok computed':>21}  others")
    for name, r in results.items():
        others = "n/a" if r["others"] is None else f"{r['others']:.2f} cores"
        print(
            f"{name:<12}{r['tok/s']:>8.1f}{r['seconds']:>9.1f}{statistics.median(r['ttft']):>15.3f}"
            f"{sum(r['computed']):>21}  {others}"
        )
    print("\nper turn: median TTFT s (no offload / offload), prompt tokens computed (no offload / offload)")
    for t in range(args.turns):
        print(
            f"  turn {t + 1}: {base['ttft'][t]:.3f} / {off['ttft'][t]:.3f}    "
            f"{base['computed'][t]} / {off['computed'][t]}   (new tokens this turn: {args.sessions * args.new_tokens})"
        )
    to_cpu, from_cpu, to_disk, from_disk = off["moved"]
    print(
        f"\nbytes moved with offload: pool->cpu {to_cpu / 2**20:.1f} MiB, cpu->pool {from_cpu / 2**20:.1f} MiB, "
        f"cpu->disk {to_disk / 2**20:.1f} MiB, disk->pool {from_disk / 2**20:.1f} MiB"
    )
    print(
        f"prompt tokens from pool / cpu / disk with offload: {off['hits'][0]} / {off['hits'][1]} / {off['hits'][2]}"
        f" (pool: {off['pool_blocks']} blocks)"
    )
    print(
        f"offload/no offload: tok/s x{off['tok/s'] / base['tok/s']:.2f}, median TTFT "
        f"/{statistics.median(base['ttft']) / statistics.median(off['ttft']):.2f}"
    )
    print(f"same tokens: {off['tokens'] == base['tokens']}")


if __name__ == "__main__":
    main()
