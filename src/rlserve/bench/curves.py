"""`rlserve bench serve --launch MODEL --curves`: how cost grows with the work, for rlserve and each
peer in the same run: throughput and latency against concurrency, prefill tokens/s and time to
first token against prompt length, throughput against n (samples per prompt, the GRPO shape), and
throughput against the prefix-cache hit rate of multi-turn sessions. JSON, and a PNG with --plot."""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
import time

import httpx

from rlserve.bench.compare import options, server_record, settle
from rlserve.bench.machine import cpu_info, describe
from rlserve.bench.metrics import RequestRecord, summarize
from rlserve.bench.serve import one_request, open_client, random_prompts, run_level, served_model
from rlserve.bench.servers import PeakMemory, Running, cpu_count, resolve_model, start_all

PREFIX_METRIC = re.compile(r"^vllm:prefix_cache_(hits|queries)(?:_total)?(?:\{[^}]*\})?\s+([0-9.eE+-]+)\s*$", re.M)


def _point(server: Running, **values) -> dict:
    return {"server": server.launch.name, "dtype": server.launch.dtype, **values}


def _level(server: Running, prompts: list[list[int]], concurrency: int, opts) -> dict:
    if opts.n > 1 and not server.launch.supports_n:
        prompts, opts = [p for p in prompts for _ in range(opts.n)], _with(opts, n=1)
    settle(opts.settle_s)
    return asyncio.run(run_level(server.url, concurrency, prompts, opts))


def _with(opts, **changes):
    import copy

    out = copy.copy(opts)
    vars(out).update(changes)
    return out


def concurrency_curve(servers: list[Running], args) -> list[dict]:
    points = []
    for i, c in enumerate(args.curve_concurrency):
        prompts = random_prompts(max(c, 4), args.prompt_len, args.vocab_size, args.seed + 10_000 + i)
        for server in servers if i % 2 == 0 else servers[::-1]:
            run = _level(server, prompts, c, options(args, args.output_len))
            points.append(_point(server, concurrency=c, **_keep(run)))
    return points


def prompt_len_curve(servers: list[Running], args) -> list[dict]:
    """One new token per request, one request at a time: the time is the prefill's."""
    points = []
    for i, length in enumerate(args.curve_prompt_lens):
        prompts = random_prompts(args.curve_prompt_count, length, args.vocab_size, args.seed + 20_000 + i)
        for server in servers if i % 2 == 0 else servers[::-1]:
            run = _level(server, prompts, 1, options(args, 1))
            prefill = run["prompt_tokens"] / run["duration_s"] if run["failed"] == 0 else None
            points.append(_point(server, prompt_len=length, prefill_tokens_per_s=prefill, **_keep(run)))
    return points


def n_curve(servers: list[Running], args) -> list[dict]:
    points = []
    for i, n in enumerate(args.curve_n):
        prompts = random_prompts(args.grpo_prompts, args.prompt_len, args.vocab_size, args.seed + 30_000 + i)
        for server in servers if i % 2 == 0 else servers[::-1]:
            run = _level(server, prompts, args.grpo_prompts * n, options(args, args.output_len, n))
            points.append(_point(server, n=n, n_as_requests=n > 1 and not server.launch.supports_n, **_keep(run)))
    return points


def _keep(run: dict) -> dict:
    keys = ("requests", "failed", "errors", "duration_s", "prompt_tokens", "output_tokens", "output_tokens_per_s",
            "total_tokens_per_s", "ttft_ms", "itl_ms", "latency_ms")  # fmt: skip
    return {k: run[k] for k in keys}


def prefix_counters(url: str) -> tuple[float, float] | None:
    """(hits, queries) in prompt tokens from the server's Prometheus counters; None where it has none."""
    with contextlib.suppress(httpx.HTTPError):
        text = httpx.get(f"{url}/metrics", timeout=30).text
        found = {"hits": 0.0, "queries": 0.0}
        seen = False
        for kind, value in PREFIX_METRIC.findall(text):
            found[kind] += float(value)
            seen = True
        return (found["hits"], found["queries"]) if seen else None
    return None


async def sessions(url: str, histories: list[list[int]], turns: int, args) -> tuple[list[RequestRecord], float]:
    """Each session sends `turns` requests in sequence; turn k's prompt is turn k-1's prompt, then an
    answer's worth of new tokens, then the next user message: its prefix is the previous prompt."""
    opts = options(args, args.output_len)
    records: list[RequestRecord] = []
    async with open_client(url, len(histories), args.timeout) as c:
        model = await served_model(c)

        async def one_session(index: int, prompt: list[int]) -> None:
            rng = random.Random(args.seed * 7919 + index)
            for turn in range(turns):
                if turn:
                    prompt = prompt + [rng.randrange(args.vocab_size) for _ in range(args.output_len + args.turn_len)]
                record = RequestRecord(prompt_tokens=len(prompt))
                body = {"model": model, "prompt": prompt, "max_tokens": opts.output_len, "ignore_eos": True,
                        "temperature": opts.temperature, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                await one_request(c, body, record)
                records.append(record)

        start = time.perf_counter()
        await asyncio.gather(*(one_session(i, h) for i, h in enumerate(histories)))
        return records, time.perf_counter() - start


def prefix_curve(servers: list[Running], args) -> list[dict]:
    points = []
    for i, turns in enumerate(args.curve_turns):
        first = random_prompts(args.sessions, args.turn_len, args.vocab_size, args.seed + 40_000 + i)
        # of all prompt tokens sent, the share that repeats the session's previous prompt
        sent = [args.turn_len + k * (args.turn_len + args.output_len) for k in range(turns)]
        reusable = sum(sent[:-1]) / sum(sent)
        for server in servers if i % 2 == 0 else servers[::-1]:
            settle(args.settle_s)
            before = prefix_counters(server.url)
            records, duration = asyncio.run(sessions(server.url, first, turns, args))
            after = prefix_counters(server.url)
            hit_rate = None
            if before and after and after[1] > before[1]:
                hit_rate = (after[0] - before[0]) / (after[1] - before[1])
            run = summarize(records, duration, args.sessions)
            points.append(_point(server, turns=turns, sessions=args.sessions, hit_rate=hit_rate,
                                 reusable_share=reusable, **_keep(run)))  # fmt: skip
    return points


CURVES = {"concurrency": concurrency_curve, "prompt_len": prompt_len_curve, "n": n_curve, "prefix_cache": prefix_curve}


def run_curves(args) -> tuple[dict, int]:
    args.threads = args.threads or cpu_count()
    cpu = cpu_info()
    print(describe(cpu), flush=True)
    model_dir = resolve_model(args.launch)
    max_len = 16 + max(max(args.curve_prompt_lens) + 1, args.prompt_len + args.output_len,
                       max(args.curve_turns) * (args.turn_len + args.output_len))  # fmt: skip
    slots = max(max(args.curve_concurrency), args.grpo_prompts * max(args.curve_n), args.sessions)
    curves: dict[str, list[dict]] = {name: [] for name in CURVES}
    servers_out, skipped = [], []
    if "offline" in (args.peer or []):  # the curves are of servers: concurrency, TTFT, prefix hits
        print("offline: skipped: the curves measure HTTP servers; --peer offline compares the workloads", flush=True)
        skipped.append({"peer": "offline", "dtype": None, "reason": "the curves measure HTTP servers"})
        args.peer = [p for p in args.peer if p != "offline"]
    for dtype in args.dtype:
        with contextlib.ExitStack() as stack:
            servers = start_all(stack, args, model_dir, dtype, max_len, slots, skipped)
            with PeakMemory(servers):
                for server in servers:
                    warm = random_prompts(2, args.prompt_len, args.vocab_size, args.seed - 1)
                    asyncio.run(run_level(server.url, 2, warm, options(args, 4)))
                for name, curve in CURVES.items():
                    print(f"{dtype}: {name} curve", flush=True)
                    curves[name] += curve(servers, args)
        servers_out += [server_record(s) for s in servers]
    emulated = not cpu["native_bf16"]
    for points in curves.values():
        for p in points:
            p["emulated"] = p["dtype"] == "bfloat16" and emulated
    result = {"kind": "serve-curves", "cpu": cpu, "model": str(model_dir), "prompt_len": args.prompt_len,
              "output_len": args.output_len, "servers": servers_out, "skipped": skipped, "curves": curves}  # fmt: skip
    failed = any(p["failed"] for points in curves.values() for p in points if p["server"] == "rlserve")
    return result, 1 if failed else 0


def curves_table(result: dict) -> str:
    lines = []
    for name, x_key, y_key in (("concurrency", "concurrency", "output_tokens_per_s"),
                               ("prompt_len", "prompt_len", "prefill_tokens_per_s"),
                               ("n", "n", "output_tokens_per_s"), ("prefix_cache", "turns", "output_tokens_per_s")):  # fmt: skip
        lines.append(f"{name}: {y_key} (TTFT p50 ms) by {x_key}")
        for p in result["curves"][name]:
            y = p.get(y_key)
            ttft = p["ttft_ms"]["p50"] if p["ttft_ms"] else None
            extra = f" hit rate {p['hit_rate']:.2f}" if p.get("hit_rate") is not None else ""
            lines.append(f"  {p['server']:>9} {p['dtype']:<8} {x_key}={p[x_key]:<5} "
                         f"{'-' if y is None else f'{y:.1f}':>8} ({'-' if ttft is None else f'{ttft:.1f}'}){extra}")  # fmt: skip
    return "\n".join(lines)
