"""Load a running server (or a deployment's router) over its OpenAI completions route: distinct
random token-id prompts, a fixed number of new tokens with EOS ignored, at each concurrency."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
from tqdm import tqdm

from rlserve.bench.metrics import RequestRecord, summarize


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def open_client(base_url: str, connections: int, timeout_s: float, headers: dict | None = None):
    """The load generator's HTTP client: aiohttp, whose per-chunk cost is a fraction of httpx's. The client
    shares the machine's cores with the server under test (streaming 64 requests, httpx took ~13% of 2 cores),
    so a leaner client leaves the server what it would have with its clients elsewhere."""
    return aiohttp.ClientSession(
        base_url=base_url.rstrip("/") + "/",  # a base with a path keeps it: the routes below are relative
        headers=headers,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=timeout_s, sock_connect=30.0),
    )


async def served_model(client: aiohttp.ClientSession) -> str:
    async with client.get("v1/models") as resp:
        resp.raise_for_status()
        return (await resp.json())["data"][0]["id"]


async def _post(client: aiohttp.ClientSession, body: dict) -> aiohttp.ClientResponse:
    """POST /v1/completions, once more on a new connection where a pooled one proves closed before the server
    answered, as the OpenAI SDK retries connection errors: llama-server closes a keep-alive connection after a
    streamed response, and aiohttp reuses it (a peer's later sequential requests failed)."""
    try:
        return await client.post("v1/completions", json=body)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError):
        return await client.post("v1/completions", json=body)


async def one_request(client: aiohttp.ClientSession, body: dict, record: RequestRecord) -> None:
    start = time.perf_counter()
    try:
        if body["stream"]:
            await _streamed(client, body, record, start)
        else:
            async with await _post(client, body) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                record.output_tokens = (await resp.json())["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, RuntimeError, KeyError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.latency = time.perf_counter() - start


async def _streamed(client: aiohttp.ClientSession, body: dict, record: RequestRecord, start: float) -> None:
    last: dict[int, float] = {}  # per choice: with n > 1 the samples' chunks interleave
    chunks, pending = 0, b""
    async with await _post(client, body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        # whatever has arrived at once, split into events here: one await per read, not per line
        async for data in resp.content.iter_any():
            *events, pending = (pending + data).split(b"\n\n")
            now = time.perf_counter()
            for raw in events:
                if not raw.startswith(b"data: ") or raw.startswith(b"data: [DONE]"):
                    continue
                event = json.loads(raw[6:])
                if event.get("usage"):
                    record.output_tokens = event["usage"]["completion_tokens"]
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
    async with open_client(base_url, concurrency, args.timeout, headers) as client:
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
            if getattr(args, "logprobs", None) is not None:
                body["logprobs"] = args.logprobs
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
