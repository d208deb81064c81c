"""Load a running server (or a deployment's router) over its OpenAI completions route: distinct
random token-id prompts, a fixed number of new tokens with EOS ignored, at each concurrency."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
from tqdm import tqdm

from rlserve.bench.metrics import RequestRecord, summarize


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


async def served_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    resp.raise_for_status()
    return resp.json()["data"][0]["id"]


async def one_request(client: httpx.AsyncClient, body: dict, record: RequestRecord) -> None:
    start = time.perf_counter()
    try:
        if body["stream"]:
            await _streamed(client, body, record, start)
        else:
            resp = await client.post("/v1/completions", json=body)
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
            record.output_tokens = resp.json()["usage"]["completion_tokens"]
    except (httpx.HTTPError, RuntimeError, KeyError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.latency = time.perf_counter() - start


async def _streamed(client: httpx.AsyncClient, body: dict, record: RequestRecord, start: float) -> None:
    last: dict[int, float] = {}  # per choice: with n > 1 the samples' chunks interleave
    chunks = 0
    async with client.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                record.output_tokens = event["usage"]["completion_tokens"]
            now = time.perf_counter()
            for choice in event.get("choices") or []:
                index = choice.get("index", 0)
                if record.ttft is None:
                    record.ttft = now - start
                if index in last:
                    record.itl.append(now - last[index])
                last[index], chunks = now, chunks + 1
    record.output_tokens = record.output_tokens or chunks


async def run_level(
    base_url: str, concurrency: int, prompts: list[list[int]], args, headers: dict | None = None
) -> dict:
    """All prompts at one concurrency level; the summary of that run."""
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(args.timeout, connect=30.0)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, limits=limits, timeout=timeout) as client:
        model = args.model or await served_model(client)
        gate = asyncio.Semaphore(concurrency)
        records = [RequestRecord(prompt_tokens=len(p)) for p in prompts]
        bar = tqdm(total=len(prompts), desc=f"concurrency {concurrency}", unit="req", disable=args.no_progress)

        async def send(prompt: list[int], record: RequestRecord) -> None:
            body = {
                "model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": args.temperature,
                "ignore_eos": True, "stream": not args.no_stream,
            }  # fmt: skip
            if getattr(args, "n", 1) > 1:
                body["n"] = args.n
            if body["stream"]:
                body["stream_options"] = {"include_usage": True}
            async with gate:
                await one_request(client, body, record)
            bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(send(p, r) for p, r in zip(prompts, records)))
        duration = time.perf_counter() - start
        bar.close()
    return summarize(records, duration, concurrency)


def run_serve(args) -> tuple[dict, list[dict]]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.warmup:  # one untimed request: the server's first step pays one-off costs
        warmup = random_prompts(1, args.prompt_len, args.vocab_size, args.seed - 1)
        asyncio.run(run_level(args.base_url, 1, warmup, _quiet(args), headers))
    runs = []
    for i, concurrency in enumerate(args.concurrency):
        count = args.num_prompts or 4 * concurrency
        # fresh prompts at every level: no level reuses another's prefix-cache entries
        prompts = random_prompts(count, args.prompt_len, args.vocab_size, args.seed + i)
        runs.append(asyncio.run(run_level(args.base_url, concurrency, prompts, args, headers)))
    meta = {
        "kind": "serve", "base_url": args.base_url, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "stream": not args.no_stream, "temperature": args.temperature,
    }  # fmt: skip
    return meta, runs


def _quiet(args):
    import copy

    quiet = copy.copy(args)
    quiet.no_progress = True
    return quiet
