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

from _server import rlserve_server
from rlserve.config import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.model.make import make_model


def workload(args, vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.clients)]


def offline(model_dir: Path, prompts, args) -> float:
    cfg = Config()
    cfg.model.name, cfg.model.max_model_len = str(model_dir), args.prompt_len + args.new_tokens + 16
    engine = Engine(cfg)
    params = SamplingParams(temperature=1.0, max_tokens=args.new_tokens, ignore_eos=True, seed=0)
    engine.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


async def _clients(url: str, prompts, args) -> float:
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

        start = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - start)


def served(model_dir: Path, prompts, args) -> float:
    with rlserve_server("--model.name", str(model_dir), "--model.max_model_len",
                        str(args.prompt_len + args.new_tokens + 16), "--server.log_level", "warning") as url:
        return asyncio.run(_clients(url, prompts, args))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--stream", action="store_true")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    model_dir = make_model(args.preset, Path("~/.cache/rlserve/bench").expanduser() / args.preset)
    from transformers import AutoConfig

    prompts = workload(args, AutoConfig.from_pretrained(model_dir).vocab_size)
    offline_tps = offline(model_dir, prompts, args)
    served_tps = served(model_dir, prompts, args)
    print(f"\nserving, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + {args.new_tokens} new tokens), "
          f"stream={args.stream}, load average {os.getloadavg()[0]:.2f}")
    print(f"{'system':34s} {'tok/s':>8s}")
    print(f"{'rlserve engine, offline':34s} {offline_tps:8.1f}")
    print(f"{'rlserve server, concurrent clients':34s} {served_tps:8.1f}")
    print(f"server / offline: {served_tps / offline_tps:.1%} (target >= 90%)")


if __name__ == "__main__":
    main()
