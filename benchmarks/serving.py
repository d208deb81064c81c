"""Server throughput under concurrent clients against the engine's offline throughput, in one run.

Same random-weight model and workload for both: C requests with random P-token prompts, N new
tokens each, temperature 1, EOS ignored. Offline = Engine.generate on all prompts at once;
served = `rlserve serve` in its own process, C concurrent /v1/completions clients (httpx), with
streaming on or off.

    python benchmarks/serving.py [--preset smollm2-135m] [--clients 64] [--stream]
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
from _server import rlserve_server
from rlserve.config import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import cache_root, make_model


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.clients)]


def offline(model_dir: Path, prompts, args) -> tuple[float, float | None]:
    """tok/s, and the cores other processes used meanwhile."""
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), args.prompt_len + args.new_tokens + 16
    engine = Engine(cfg)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    with OtherLoad() as load:
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed, load.cores


async def _clients(url: str, server_pid: int, prompts, args) -> tuple[float, float | None]:
    body = {"max_tokens": args.new_tokens, "temperature": 1.0, "ignore_eos": True, "stream": args.stream}
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        await client.post("/v1/completions", json={**body, "prompt": prompts[0], "max_tokens": 2, "stream": False})

        async def one(prompt) -> int:
            if not args.stream:
                r = await client.post("/v1/completions", json={**body, "prompt": prompt, "return_token_ids": True})
                return len(r.json()["choices"][0]["token_ids"])
            count = 0
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt, "return_token_ids": True}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        import json

                        for choice in json.loads(line[6:]).get("choices", []):
                            count += len(choice.get("token_ids") or [])
            return count

        with OtherLoad(server_pid) as load:  # the clients (this process) and the server are the run
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.perf_counter() - start
        return sum(counts) / elapsed, load.cores


def served(model_dir: Path, prompts, args) -> tuple[float, float | None]:
    with rlserve_server("--model.name", str(model_dir), "--model.max_model_len",
                        str(args.prompt_len + args.new_tokens + 16), "--server.log_level", "warning") as server:
        return asyncio.run(_clients(server.url, server.pid, prompts, args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = make_model(args.preset, cache_root() / "bench" / args.preset)
    from transformers import AutoConfig

    prompts = workload(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    offline_tps, offline_others = offline(model_dir, prompts, args)
    served_tps, served_others = served(model_dir, prompts, args)
    print(f"\nserving, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + {args.new_tokens} new tokens), "
          f"stream={args.stream}")
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
