"""Server throughput under concurrent clients against the engine's offline throughput, in one run.

Same random-weight model and workload for both: C requests with random P-token prompts, N new
tokens each, temperature 1, EOS ignored. Offline = Engine.generate on all prompts at once;
served = `rlserve serve` in its own process, C concurrent /v1/completions clients (httpx), with
streaming on or off.

    python benchmarks/serving.py [--preset smollm2-135m] [--clients 64] [--stream]

--deployment instead compares, on the same workload, 2 replicas x 1 thread behind vllm-router
(`--deployment.replicas 2`) with 1 server x 2 threads, and measures the router's cost: p50/p99
latency of a 1-token request sent to a replica directly and through the router, alternating.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from pathlib import Path

import httpx
import torch

from _cpu import OtherLoad
from _server import add_workload_args, clients, rlserve_server, served, workload_args
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import bench_cache_dir, make_model


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.clients)]


def offline(model_dir: Path, prompts, args, threads: int | None = None) -> tuple[float, float | None]:
    """tok/s, and the cores other processes used meanwhile (`threads`: the engine's; none = all cores)."""
    cfg = Config(num_threads=threads)
    cfg.model.name, cfg.model.max_model_len = str(model_dir), args.prompt_len + args.new_tokens + 16
    engine = Engine(cfg)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    with OtherLoad() as load:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, load.cores


async def _latencies(urls: list[str], n: int) -> list[list[float]]:
    """Seconds per 1-token request to each URL, sent one at a time, alternating between the URLs."""
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "temperature": 0}
    out: list[list[float]] = [[] for _ in urls]
    async with httpx.AsyncClient(timeout=60) as client:
        for url in urls:  # warm connections and caches
            await client.post(f"{url}/v1/completions", json=body)
        for _ in range(n):
            for i, url in enumerate(urls):
                start = time.perf_counter()
                r = await client.post(f"{url}/v1/completions", json=body)
                out[i].append(time.perf_counter() - start)
                r.raise_for_status()
    return out


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def deployment(model_dir: Path, prompts, args) -> None:
    common = workload_args(model_dir, args)
    with rlserve_server(*common, "--num_threads", "2") as single:
        single_tps, single_others = asyncio.run(
            clients(single.url, single.pids(), prompts, args.new_tokens, args.stream)
        )
    with rlserve_server(*common, "--deployment.replicas", "2", "--num_threads", "1") as dep:
        dep_tps, dep_others = asyncio.run(clients(dep.url, dep.pids(), prompts, args.new_tokens, args.stream))
        replica = httpx.get(f"{dep.admin_url}/deployment", timeout=30).json()["replicas"][0]["url"]
        direct, routed = asyncio.run(_latencies([replica, dep.url], args.latency_requests))
    print(
        f"\ndeployment, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + {args.new_tokens} new "
        f"tokens), stream={args.stream}"
    )
    print(f"{'system':38s} {'tok/s':>8s} {'others':>7s}")
    for name, tps, others in (
        ("1 server x 2 threads", single_tps, single_others),
        ("2 replicas x 1 thread, vllm-router", dep_tps, dep_others),
    ):
        print(f"{name:38s} {tps:8.1f} {'-' if others is None else f'{others:.2f}':>7s}")
    print(f"2 replicas / 1 server: {dep_tps / single_tps:.2f}x (target >= 0.9x)")
    print(
        f"1-token request latency over {args.latency_requests} requests (ms): direct p50 "
        f"{_quantile(direct, 0.5) * 1e3:.2f} p99 {_quantile(direct, 0.99) * 1e3:.2f}; via router p50 "
        f"{_quantile(routed, 0.5) * 1e3:.2f} p99 {_quantile(routed, 0.99) * 1e3:.2f}; router adds p50 "
        f"{(_quantile(routed, 0.5) - _quantile(direct, 0.5)) * 1e3:.2f} ms (target < 1 ms)"
    )
    print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(p)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--deployment", action="store_true", help="2 replicas behind vllm-router vs 1 server")
    p.add_argument("--latency-requests", type=int, default=200)
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = make_model(args.preset, bench_cache_dir() / args.preset)
    from transformers import AutoConfig

    prompts = workload(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    if args.deployment:
        deployment(model_dir, prompts, args)
        return
    offline_tps, offline_others = offline(model_dir, prompts, args)
    served_tps, served_others = served(model_dir, prompts, args, args.stream)
    print(
        f"\nserving, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + {args.new_tokens} new tokens), "
        f"stream={args.stream}"
    )
    print(f"{'system':34s} {'tok/s':>8s} {'others':>7s}")
    for name, tps, others in (
        ("rlserve engine, offline", offline_tps, offline_others),
        ("rlserve server, concurrent clients", served_tps, served_others),
    ):
        print(f"{name:34s} {tps:8.1f} {'-' if others is None else f'{others:.2f}':>7s}")
    print(f"server / offline: {served_tps / offline_tps:.1%} (target >= 90%)")
    print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


if __name__ == "__main__":
    main()
