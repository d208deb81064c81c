"""The batch-forming window (--flush-interval-ms / engine.batch_window_ms) on burst arrivals.

A burst of B requests reaches an idle server, spread over `--spread-ms`; without a window the first one starts
alone and the others join the running batch step by step (each joiner's prefill is a step of its own); with
one, admission waits up to the window for more, so the burst is prefilled in fewer steps. Reported per window:
burst throughput (completion tokens / burst wall time), time to first token (median, p90), engine steps per
burst and the largest batch the requests saw (metadata.batch_size).

    python benchmarks/batch_window.py --windows 0 20 --burst 8 --rounds 5
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import httpx

from _server import rlserve_server


async def one(client: httpx.AsyncClient, url: str, delay: float, new_tokens: int) -> tuple[float, int]:
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    body = {
        "prompt": "Tell me a story about a robot who learns to paint.",
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    answer = (await client.post(f"{url}/generate", json=body)).json()
    # /generate answers whole; TTFT is taken from a second, streaming probe below
    return time.perf_counter() - sent, answer["metadata"]["batch_size"]


async def first_token(client: httpx.AsyncClient, url: str, delay: float, new_tokens: int) -> float:
    await asyncio.sleep(delay)
    sent = time.perf_counter()
    body = {
        "prompt": "Tell me a story about a robot who learns to paint.",
        "max_tokens": new_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
    }
    ttft = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():  # read to the end: the request runs its full length
            if ttft is None and line.startswith("data: {"):
                ttft = time.perf_counter() - sent
    return ttft


async def bursts(url: str, args) -> dict[str, float]:
    delays = [i * args.spread_ms / 1000 / max(args.burst - 1, 1) for i in range(args.burst)]
    walls, ttfts, steps, sizes = [], [], [], []
    async with httpx.AsyncClient(timeout=600) as client:
        for _ in range(args.rounds):
            before = (await client.get(f"{url}/metrics?format=json")).json()["num_steps"]
            start = time.perf_counter()
            done = await asyncio.gather(*(one(client, url, d, args.new_tokens) for d in delays))
            walls.append(time.perf_counter() - start)
            steps.append((await client.get(f"{url}/metrics?format=json")).json()["num_steps"] - before)
            sizes.append(max(size for _, size in done))
            ttfts += await asyncio.gather(*(first_token(client, url, d, args.new_tokens) for d in delays))
    wall = statistics.median(walls)
    ttfts.sort()
    return {
        "tok_s": args.burst * args.new_tokens / wall,
        "wall_ms": wall * 1000,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p90_ms": ttfts[int(0.9 * (len(ttfts) - 1))] * 1000,
        "steps": statistics.median(steps),
        "batch": max(sizes),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model directory; none = the embedded tiny model")
    p.add_argument("--windows", type=float, nargs="+", default=[0, 20], help="windows to compare, in ms")
    p.add_argument("--burst", type=int, default=8, help="requests per burst (also --max-batch)")
    p.add_argument("--spread-ms", type=float, default=10, help="the burst's requests arrive over this long")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    print(f"burst {args.burst} over {args.spread_ms} ms, {args.new_tokens} new tokens, {args.rounds} rounds")
    print(f"{'window_ms':>9} {'tok/s':>8} {'burst_ms':>9} {'ttft_p50':>9} {'ttft_p90':>9} {'steps':>6} {'batch':>6}")
    for window in args.windows:
        model = ("--model", args.model) if args.model else ()
        with rlserve_server(*model, "--max-batch", str(args.burst), "--flush-interval-ms", str(window)) as server:
            r = asyncio.run(bursts(server.url, args))
        print(
            f"{window:>9g} {r['tok_s']:>8.1f} {r['wall_ms']:>9.1f} {r['ttft_p50_ms']:>9.1f} {r['ttft_p90_ms']:>9.1f}"
            f" {r['steps']:>6g} {r['batch']:>6d}"
        )


if __name__ == "__main__":
    main()
