"""`rlserve bench serve --launch MODEL [--peer vllm] [--peer llama.cpp] [--peer offline]`: rlserve
against its peers on the same weights and the same machine, in one run (the offline peer is
rlserve's own engine without HTTP: the ratio over it is what the HTTP path keeps). Per dtype all servers are up together and
take turns on each workload, the order alternating by round, so the machine's drift lands on all
of them, and each run starts once the others have gone quiet (a server's threads can spin on after
its turn); a ratio is the median of the rounds' ratios. Workloads: distinct prompts all at once,
batch 1, and the GRPO shape (prompts x n samples). Streaming /v1/completions with token-id
prompts, EOS ignored. Each figure is printed with its share of the machine's limit for that workload
(bench/limits.py), measured before the servers start."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

from rlserve.bench import offline
from rlserve.bench.limits import ModelCost, matmul_peak, memory_bandwidth, workload_limit
from rlserve.bench.machine import OtherLoad, cpu_info, describe, wait_quiet
from rlserve.bench.serve import random_prompts, run_level
from rlserve.bench.servers import PeakMemory, Running, cpu_count, resolve_model, start_all

# rlserve's tok/s over each peer's that the issue asks for; bf16 targets assume native bf16. Over the
# offline peer (its own engine without HTTP) the ratio is what the HTTP path keeps of the engine's speed
TARGETS = {"vllm": 1.5, "llama.cpp": 1.0, "offline": 0.9}


@dataclass(frozen=True, slots=True)
class Workload:
    name: str
    prompts: int
    output_len: int
    n: int = 1

    @property
    def requests(self) -> int:
        return self.prompts * self.n


def workloads(args) -> list[Workload]:
    every = {
        "concurrent": Workload(f"{args.num_prompts} concurrent", args.num_prompts, args.output_len),
        "batch1": Workload("batch 1", 1, args.single_output_len),
        "grpo": Workload(f"GRPO {args.grpo_prompts}x n={args.grpo_n}", args.grpo_prompts, args.output_len, args.grpo_n),
    }
    return [every[name] for name in args.workloads]


def options(args, output_len: int, n: int = 1) -> SimpleNamespace:
    return SimpleNamespace(model=None, output_len=output_len, temperature=args.temperature, no_stream=False,
                           no_progress=True, timeout=args.timeout, n=n, settle_s=args.settle_s,
                           logprobs=args.logprobs)  # fmt: skip


def measure(server: Running, workload: Workload, prompts: list[list[int]], args) -> dict:
    """One workload against one server, once the machine is quiet: run_level's summary plus other processes'
    cores meanwhile and the wait. A peer without `n` gets each prompt n times as separate requests."""
    n = workload.n
    if n > 1 and not server.launch.supports_n:
        prompts, n = [p for p in prompts for _ in range(n)], 1
    quiet, waited = settle(args.settle_s)
    with OtherLoad(*server.pids_seen, server.proc.pid) as load:
        run = run_workload(server, workload.requests, prompts, options(args, workload.output_len, n))
    return {**run, "other_cores": load.cores, "quiet_before": quiet, "settle_s": waited,
            "n_as_requests": workload.n > 1 and not server.launch.supports_n}  # fmt: skip


def run_workload(server: Running, concurrency: int, prompts: list[list[int]], opts) -> dict:
    """All prompts at once on a server through HTTP (run_level), or on the offline peer's engine."""
    if server.launch.offline:
        return offline.run_remote(server.url, prompts, opts)
    return asyncio.run(run_level(server.url, concurrency, prompts, opts))


def settle(limit_s: float) -> tuple[bool | None, float]:
    """wait_quiet for at most limit_s, saying so when the machine did not go quiet (the run then starts
    anyway); (None, 0.0) when limit_s is 0"""
    if limit_s <= 0:
        return None, 0.0
    quiet, waited = wait_quiet(limit=limit_s)
    if not quiet:
        print(f"  (other processes kept the machine busy for {waited:.1f} s; measuring anyway)", flush=True)
    return quiet, waited


def rounds(servers: list[Running], plan: list[Workload], args, seed: int) -> dict[tuple[str, str], list[dict]]:
    """(workload, server label) -> one run per round; the same prompts for every server within a round."""
    got: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        for i, workload in enumerate(plan):
            prompts = random_prompts(workload.prompts, args.prompt_len, args.vocab_size, seed + 100 * r + i)
            order = servers if (r + i) % 2 == 0 else servers[::-1]
            for server in order:
                run = measure(server, workload, prompts, args)
                got.setdefault((workload.name, server.label), []).append(run)
                failed = f"  ({run['failed']} failed)" if run["failed"] else ""
                tok_s = run["output_tokens_per_s"]
                print(f"  round {r + 1} {workload.name:<20} {server.label:<20} {tok_s:8.1f} tok/s{failed}", flush=True)
    return got


def _median_run(runs: list[dict]) -> dict:
    return sorted(runs, key=lambda r: r["output_tokens_per_s"])[len(runs) // 2]


def measure_limits(dtype: str, model_dir: Path, plan: list[Workload], args) -> dict:
    """This machine's matmul peak and bandwidth (on the benchmark's threads, before any server runs) and each
    workload's output tokens/s limit from them (None for a model ModelCost does not count)."""
    import torch

    torch.set_num_threads(args.threads)
    torch_dtype = getattr(torch, dtype)
    paths = matmul_peak(torch_dtype)
    peak, bandwidth = max(paths.values()), memory_bandwidth()
    config = json.loads((model_dir / "config.json").read_text())
    cost = ModelCost.from_config(config, torch_dtype.itemsize)
    per_workload = {
        w.name: None if cost is None else workload_limit(cost, w.prompts, w.n, args.prompt_len, w.output_len, peak, bandwidth)
        for w in plan
    }  # fmt: skip
    return {"matmul_gflops": paths, "peak_gflops": peak, "bandwidth_gb_s": bandwidth, "tok_s": per_workload}


def summarize_dtype(
    dtype: str, servers: list[Running], plan: list[Workload], got: dict, native_bf16: bool, limits: dict
) -> tuple:
    emulated = dtype == "bfloat16" and not native_bf16
    results, ratios = [], []
    ours = servers[0]
    for workload in plan:
        limit = limits["tok_s"][workload.name]
        for server in servers:
            runs = got[(workload.name, server.label)]
            mid = _median_run(runs)
            tok_s = statistics.median(r["output_tokens_per_s"] for r in runs)
            results.append({
                "dtype": dtype, "workload": workload.name, "server": server.launch.name, "emulated": emulated,
                "prompts": workload.prompts, "n": workload.n, "output_len": workload.output_len,
                "output_tokens_per_s": tok_s,
                "rounds": [r["output_tokens_per_s"] for r in runs], "failed": sum(r["failed"] for r in runs),
                "errors": sorted({e for r in runs for e in r["errors"]})[:3],
                "ttft_ms": mid["ttft_ms"], "itl_ms": mid["itl_ms"], "latency_ms": mid["latency_ms"],
                "other_cores": max((r["other_cores"] for r in runs if r["other_cores"] is not None), default=None),
                "quiet_before": [r["quiet_before"] for r in runs], "settle_s": [r["settle_s"] for r in runs],
                "n_as_requests": mid["n_as_requests"], "limit_tok_s": limit,
                "share_of_limit": None if not limit else tok_s / limit,
            })  # fmt: skip
            if server is ours:
                continue
            mine, theirs = got[(workload.name, ours.label)], runs
            each = sorted(a["output_tokens_per_s"] / max(b["output_tokens_per_s"], 1e-9) for a, b in zip(mine, theirs))
            ratio, target = statistics.median(each), TARGETS[server.launch.kind]
            ratios.append({
                "dtype": dtype, "workload": workload.name, "peer": server.launch.name, "ratio": ratio,
                "rounds": each, "target": target, "targets_applied": not emulated,
                "met": None if emulated else ratio >= target, "emulated": emulated,
            })  # fmt: skip
    return results, ratios


def server_record(server: Running) -> dict:
    return {"server": server.launch.name, "dtype": server.launch.dtype, "pid": server.proc.pid,
            "pids": sorted(server.pids_seen), "peak_rss_bytes": server.peak_rss, "command": server.launch.cmd,
            "env": server.launch.env}  # fmt: skip


def run_compare(args) -> tuple[dict, int]:
    """The whole comparison: JSON-ready result, and the exit status (1 when rlserve's requests failed)."""
    args.threads = args.threads or cpu_count()
    cpu = cpu_info()
    print(describe(cpu), flush=True)
    model_dir = resolve_model(args.launch)
    plan = workloads(args)
    max_len = args.prompt_len + max(w.output_len for w in plan) + 16
    slots = max(w.requests for w in plan)
    results, ratios, servers_out, skipped, limits = [], [], [], [], {}
    for seed, dtype in enumerate(args.dtype, start=1):
        limits[dtype] = measure_limits(dtype, model_dir, plan, args)
        print(limits_line(dtype, limits[dtype]), flush=True)
        with contextlib.ExitStack() as stack:
            servers = start_all(stack, args, model_dir, dtype, max_len, slots, skipped)
            with PeakMemory(servers):
                for server in servers:  # untimed: first steps pay one-off costs (graphs, allocations)
                    warm = random_prompts(2, args.prompt_len, args.vocab_size, args.seed - seed)
                    run_workload(server, 2, warm, options(args, 4))
                got = rounds(servers, plan, args, args.seed + 1000 * seed)
        servers_out += [server_record(s) for s in servers]
        r, q = summarize_dtype(dtype, servers, plan, got, cpu["native_bf16"], limits[dtype])
        results += r
        ratios += q
    result = {
        "kind": "serve-compare", "cpu": cpu, "model": str(model_dir), "prompt_len": args.prompt_len,
        "temperature": args.temperature, "rounds": args.rounds, "threads": args.threads,
        "workloads": [dataclasses.asdict(w) for w in plan],
        "servers": servers_out, "skipped": skipped, "results": results, "ratios": ratios, "limits": limits,
    }  # fmt: skip
    failed = any(r["failed"] for r in results if r["server"] == "rlserve")
    return result, 1 if failed else 0


def limits_line(dtype: str, limits: dict) -> str:
    best = max(limits["matmul_gflops"], key=limits["matmul_gflops"].get)
    shown = ", ".join(f"{name} {tok_s:.0f}" for name, tok_s in limits["tok_s"].items() if tok_s)
    return (f"{dtype} limits: matmul peak {limits['peak_gflops']:.0f} GFLOP/s ({best}), memory {limits['bandwidth_gb_s']:.1f} "
            f"GB/s; at most {shown or '- (not counted for this model)'} output tok/s")  # fmt: skip


def compare_table(result: dict) -> str:
    """One row per dtype, workload and server; the peers' rows carry rlserve's ratio over them."""
    ratio = {(q["dtype"], q["workload"], q["peer"]): q for q in result["ratios"]}
    head = ["dtype", "workload", "server", "tok/s", "of limit", "per round", "rlserve/x", "TTFT p50", "TTFT p99",
            "ITL p50", "ITL p99", "others"]  # fmt: skip
    rows = [head]
    for r in result["results"]:
        q = ratio.get((r["dtype"], r["workload"], r["server"]))
        shown = ""
        if q:
            verdict = "emulated: no target" if not q["targets_applied"] else ("met" if q["met"] else "missed")
            shown = f"{q['ratio']:.2f}x (>= {q['target']}x: {verdict})"
        lat = [f"{r[k][p]:.1f}" if r[k] else "-" for k in ("ttft_ms", "itl_ms") for p in ("p50", "p99")]
        dtype = r["dtype"] + (" (emulated)" if r["emulated"] else "")
        rows.append([dtype, r["workload"], r["server"] + (f" ({r['failed']} failed)" if r["failed"] else ""),
                     f"{r['output_tokens_per_s']:.1f}", _share(r.get("share_of_limit")), " ".join(f"{x:.0f}" for x in r["rounds"]), shown, *lat,
                     "-" if r["other_cores"] is None else f"{r['other_cores']:.2f}"])  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in rows
    ]
    lines.append("TTFT/ITL in ms (the median round's percentiles); others = cores other processes used meanwhile")
    lines.append("of limit = tok/s over the most this machine allows the workload (bench/limits.py):")
    lines += [f"  {limits_line(dtype, limits)}" for dtype, limits in result.get("limits", {}).items()]
    lines.append("peak resident memory (the process tree's summed RSS):")
    for s in result["servers"]:
        rss = "-" if s["peak_rss_bytes"] is None else f"{s['peak_rss_bytes'] / 2**20:.0f} MiB"
        lines.append(f"  {s['server']} {s['dtype']}: {rss}")
    return "\n".join(lines)


def _share(share: float | None) -> str:
    return "-" if share is None else f"{share:.0%}"
