"""Prefill/decode disaggregation against one server, on a prefill-heavy workload, in one run.

Same random-weight model and workload for both: C concurrent streaming /v1/completions clients, each a
random P-token prompt and N new tokens (temperature 1, EOS ignored). One server with every core against
`deployment.type = "disaggregated"` (1 prefill + 1 decode server, each half the cores, behind vllm-router in
P/D mode). Reported: time to first token (p50, mean), tokens/s, and the KV transfer rate the decode server
measured (its /metrics: bytes pulled / seconds pulling) against a raw loopback TCP copy of the same bytes.

What is timed. A transfer: on the decode server, from its engine taking the request (the pull starts) to
the blocks registered in its pool, usable by the scheduler: connection set-up, the pull request, every
block received straight into its pool block and its checksum checked there, the engine noticing the
landed pull. The prefill server hashes each block before sending it. The raw copy that the target is set
against: the same KV bytes (without the transfer's framing) from a buffer of their size in one process into
memory in another, the sender on the prefill server's cores and the receiver on the decode server's, over a
fresh loopback TCP connection with the same socket options (TCP_NODELAY, 8 MiB buffers), connection set-up
included, in block-sized writes; no hashing, no framing, no engine. Its destination is laid out and aged as
the decode pool's free blocks that the transfer lands in: a block is one run of 16 tokens in each layer's K
and V region (60 runs of 12 KB on smollm2-135m), filled by recvmsg_into as the transfer fills them, in
memory touched when the deployment started and not since. That matters on this project's VMs: memory left
idle for a minute or two writes at 1-10 GB/s at first, against ~10-25 GB/s a moment later (whatever it
holds; how slow varies from minute to minute and from one deployment to the next), and scattered runs pay it
more than one sequential buffer does. So the ratio is what rlserve's own work costs, on the same cores and
the same kind of memory. Printed beside it: the same copy into one buffer touched a moment before; in this
process and unbound, the copy into one reused block-sized buffer (cache-warm: no transfer that keeps the
bytes can match it) and between buffers of the transfer's size; and the plain write speed of idle memory
against the same memory written again. Each lone transfer is followed by one of each, so that all see the
same minute of a noisy machine; medians are quoted.

    python benchmarks/pd.py [--preset smollm2-135m] [--clients 16] [--prompt-len 1024] [--new-tokens 32]
    python benchmarks/pd.py --quick            # tiny model, small counts: a smoke test
    python benchmarks/pd.py --transfer-only    # only the lone transfers and the raw copy (no workload)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from _cpu import OtherLoad
from _server import add_workload_args, rlserve_server
from rlserve.engine.kv.wire import _recv_views, tune_socket
from rlserve.model.make import cache_root, make_model

LONE_PULLS = 7  # one pull is a noisy figure on a shared machine: the median of these is quoted
PROBE_BYTES = 16 << 20  # per lone pull: idle memory whose plain write speed is timed


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p, clients=16, prompt_len=1024, new_tokens=32)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--transfer-only", action="store_true", help="skip the workload: lone transfers vs raw copy")
    args = p.parse_args()
    if args.quick:
        args.preset, args.clients, args.prompt_len, args.new_tokens = "tiny", 4, 128, 8
    return args


async def _clients(url: str, pids: list[int], prompts: list[list[int]], args) -> dict:
    body = {
        "max_tokens": args.new_tokens,
        "temperature": 1.0,
        "ignore_eos": True,
        "stream": True,
        "return_token_ids": True,
    }
    limits = httpx.Limits(max_connections=args.clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=1200, limits=limits) as client:
        warm = [random.Random(99).randrange(1000) for _ in range(64)]
        await client.post("/v1/completions", json={**body, "prompt": warm, "max_tokens": 2, "stream": False})

        async def one(prompt) -> tuple[float, int]:
            start, first, count = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/completions", json={**body, "prompt": prompt}) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        for choice in json.loads(line[6:]).get("choices", []):
                            n = len(choice.get("token_ids") or [])
                            if n and first is None:
                                first = time.perf_counter() - start
                            count += n
            return first or float("nan"), count

        with OtherLoad(*pids) as load:
            start = time.perf_counter()
            results = await asyncio.gather(*(one(p) for p in prompts))
            elapsed = time.perf_counter() - start
    ttfts = sorted(t for t, _ in results)
    return {
        "ttft_p50": ttfts[len(ttfts) // 2],
        "ttft_mean": sum(ttfts) / len(ttfts),
        "tok_s": sum(c for _, c in results) / elapsed,
        "others": load.cores,
    }


def _metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and s.labels.get("direction", "in") == "in"
    )


def raw_socket_rate(nbytes: int, chunk: int, resident: bool = False, into: memoryview | None = None) -> float:
    """Bytes/s of a plain loopback TCP copy of nbytes in chunk-sized writes (the KV blocks' size), set up
    and timed as a transfer is (see the module's docstring). Cache-hot (the default): one chunk-sized
    source sent again and again into one chunk-sized destination, so neither side touches memory beyond
    the cache. resident: from an nbytes source into an nbytes destination, as the KV bytes move (a pool on
    each side); both touched before, so page faults are not counted. into: the destination instead (nbytes
    of memory the caller touched long ago, as a decode server's unused pool blocks were)."""
    server = socket.create_server(("127.0.0.1", 0))
    size = nbytes if resident or into is not None else chunk
    source = memoryview(bytearray(b"\x01" * size))
    # touched before: a fresh buffer's page faults are not the socket's cost
    view = into if into is not None else memoryview(bytearray(b"\x01" * size))

    def send() -> None:
        conn, _ = server.accept()
        with conn:
            tune_socket(conn, 60)
            sent = 0
            while sent < nbytes:
                at = sent % size
                conn.sendall(source[at : at + min(chunk, nbytes - sent)])
                sent += chunk

    thread = threading.Thread(target=send)
    thread.start()
    start, got = time.perf_counter(), 0
    with socket.create_connection(server.getsockname()) as sock:
        tune_socket(sock, 60)
        while got < nbytes:
            at = got % size
            n = sock.recv_into(view[at : at + min(chunk, size - at)])
            if n == 0:
                break
            got += n
        elapsed = time.perf_counter() - start
    thread.join()
    server.close()
    return got / elapsed


def _idle_write_rates(region: memoryview) -> tuple[float, float]:
    """Bytes/s of writing a region of long-untouched memory, then of writing it again at once."""
    source = b"\x02" * len(region)
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        region[:] = source
        rates.append(len(region) / (time.perf_counter() - start))
    return rates[0], rates[1]


# the sending side of raw_copy_between, a process of its own: it touches its source, listens, says its port,
# and sends nbytes in chunk-sized writes to the one connection it accepts
_RAW_SENDER = """
import os, socket, sys
from rlserve.engine.kv.wire import _recv_views, tune_socket
cores, nbytes, chunk = [int(c) for c in sys.argv[1].split(",")], int(sys.argv[2]), int(sys.argv[3])
os.sched_setaffinity(0, cores)
source = memoryview(bytearray(b"\\x01" * nbytes))
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
tune_socket(conn, 60)
for at in range(0, nbytes, chunk):
    conn.sendall(source[at : at + chunk])
conn.close()
"""


def raw_copy_between(
    send_cores: set[int], recv_cores: set[int], nbytes: int, chunk: int, into: list[memoryview] | None = None
) -> float:
    """Bytes/s of the memory-resident raw copy (see raw_socket_rate) between two processes placed as the
    prefill and decode servers are: the sender in a process of its own on the prefill server's cores, the
    receiver (this thread) on the decode server's. Everything the transfer has but rlserve's own work.
    into: the destination, views filled in order as the transfer fills a pool's block runs (recvmsg_into, as
    the transfer's own receive loop does), instead of one buffer touched a moment before."""
    sender = subprocess.Popen(
        [sys.executable, "-c", _RAW_SENDER, ",".join(map(str, sorted(send_cores))), str(nbytes), str(chunk)],
        stdout=subprocess.PIPE,
        text=True,
    )
    mine = os.sched_getaffinity(0)
    try:
        port = int(sender.stdout.readline())
        os.sched_setaffinity(0, recv_cores)  # this thread only (Linux)
        view = None if into is not None else memoryview(bytearray(b"\x01" * nbytes))
        start, got = time.perf_counter(), 0
        with socket.create_connection(("127.0.0.1", port)) as sock:
            tune_socket(sock, 60)
            if view is not None:
                while got < nbytes:
                    n = sock.recv_into(view[got : got + chunk])
                    if n == 0:
                        break
                    got += n
            else:
                _recv_views(sock, into)  # the kernel's scatter, short receives resumed where they stopped
                got = nbytes
            elapsed = time.perf_counter() - start
        sender.wait(timeout=60)
    finally:
        os.sched_setaffinity(0, mine)
        if sender.poll() is None:
            sender.kill()
            sender.wait()
    return got / elapsed


def _touched(nbytes: int) -> memoryview:
    """nbytes of zeroed memory with every page written once, now: mapped, as a pool is when its server starts."""
    memory = memoryview(bytearray(nbytes))
    memory[::4096] = b"\x01" * len(range(0, nbytes, 4096))
    return memory


class AgedPool:
    """Memory laid out as a decode pool's KV ([layers, k/v, slots, heads, head_dim]: a block is one run of
    block_size tokens in each of the 2 x layers regions) and touched once, now, as the pool is when its
    server starts; room for `pulls` transfers of `blocks` blocks, each into blocks of its own."""

    def __init__(self, model_dir, pulls: int, blocks: int, block_size: int = 16):
        config = json.loads((model_dir / "config.json").read_text())
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        itemsize = 4 if config.get("torch_dtype", "float32") == "float32" else 2
        self.runs, self.run_bytes, self.blocks = (
            2 * config["num_hidden_layers"],
            block_size * config["num_key_value_heads"] * head_dim * itemsize,
            blocks,
        )
        self.region = pulls * blocks * self.run_bytes
        self.memory = _touched(self.runs * self.region)

    def views(self, pull: int) -> list[memoryview]:
        """Pull `pull`'s destinations in the order its bytes arrive: block by block, each block's runs."""
        return [
            self.memory[r * self.region + (pull * self.blocks + b) * self.run_bytes :][: self.run_bytes]
            for b in range(self.blocks)
            for r in range(self.runs)
        ]


def main() -> None:
    args = parse_args()
    model_dir = make_model(args.preset, cache_root() / "bench" / args.preset)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(10, 30000 if args.preset != "tiny" else 1000) for _ in range(args.prompt_len)]
        for _ in range(args.clients)
    ]
    cores = len(os.sched_getaffinity(0))
    common = (
        "--model.name",
        str(model_dir),
        "--model.max_model_len",
        str(args.prompt_len + args.new_tokens + 64),
        "--server.log_level",
        "warning",
        "--engine.kv_cache_bytes",
        str(1 << 30),
    )
    one = None
    if not args.transfer_only:
        with rlserve_server(*common, "--num_threads", str(cores)) as single:
            one = asyncio.run(_clients(single.url, single.pids(), prompts, args))
    with rlserve_server(*common, "--deployment.type", "disaggregated", "--num_threads", str(max(1, cores // 2))) as dep:
        # destinations for raw copies into memory as long untouched as the decode server's pool blocks that the
        # lone pulls land in (zeroed at its start, unused since), and a stretch of it to time plain writes into:
        # on this project's VMs memory left idle for a minute or two writes at 1-10 GB/s at first, against
        # ~10-25 a moment later, whatever it holds, and how slow varies from minute to minute
        blocks = (args.prompt_len - 1) // 16  # a pull's blocks: every full block of the prompt but its last token
        aged = AgedPool(model_dir, LONE_PULLS, blocks)
        probe = _touched(LONE_PULLS * PROBE_BYTES)
        d = sorted(httpx.get(f"{dep.admin_url}/deployment", timeout=30).json()["replicas"], key=lambda r: r["index"])
        decode = d[1]["url"]
        # the cores the prefill and decode servers run on (their engine processes inherit them)
        p_cores, d_cores = (os.sched_getaffinity(r["pid"]) for r in d[:2])
        base = {
            n: _metric(decode, n)
            for n in (
                "rlserve:kv_transfer_bytes_total",
                "rlserve:kv_transfer_seconds_total",
                "rlserve:kv_transfer_tokens_total",
            )
        }
        pd = None if args.transfer_only else asyncio.run(_clients(dep.url, dep.pids(), prompts, args))
        moved = {n: _metric(decode, n) - v for n, v in base.items()}
        fallbacks = _metric(decode, "rlserve:kv_transfer_local_fallbacks_total")
        # more requests alone: the pull without 15 others and both engines' compute competing for the cores;
        # each followed by the raw copy of its bytes, so that both see the same machine
        lone_rates, aged_rates, placed_rates, raw_rates, resident_rates, idle_writes = [], [], [], [], [], []
        for i in range(LONE_PULLS):
            alone_base = {n: _metric(decode, n) for n in base}
            lone = [rng.randrange(10, 30000 if args.preset != "tiny" else 1000) for _ in range(args.prompt_len)]
            httpx.post(
                f"{dep.url}/v1/completions", json={"prompt": lone, "max_tokens": 1}, timeout=1200
            ).raise_for_status()
            alone = {n: _metric(decode, n) - v for n, v in alone_base.items()}
            lone_rates.append(
                alone["rlserve:kv_transfer_bytes_total"] / max(alone["rlserve:kv_transfer_seconds_total"], 1e-9)
            )
            lone_bytes = int(alone["rlserve:kv_transfer_bytes_total"]) or (64 << 20)
            block_bytes = int(lone_bytes / max(1, alone["rlserve:kv_transfer_tokens_total"] / 16)) or (1 << 20)
            idle_writes.append(_idle_write_rates(probe[i * PROBE_BYTES : (i + 1) * PROBE_BYTES]))
            kv_bytes = aged.runs * aged.run_bytes
            aged_rates.append(raw_copy_between(p_cores, d_cores, blocks * kv_bytes, kv_bytes, into=aged.views(i)))
            placed_rates.append(raw_copy_between(p_cores, d_cores, lone_bytes, block_bytes))
            raw_rates.append(raw_socket_rate(lone_bytes, block_bytes))
            resident_rates.append(raw_socket_rate(lone_bytes, block_bytes, resident=True))

    print(
        f"\nP/D, {args.preset}, {args.clients} clients x ({args.prompt_len} prompt + {args.new_tokens} new tokens), "
        f"streamed, {cores} cores"
    )
    if one is not None and pd is not None:
        nbytes, seconds = moved["rlserve:kv_transfer_bytes_total"], moved["rlserve:kv_transfer_seconds_total"]
        pulled = nbytes / seconds if seconds else float("nan")
        print(f"{'system':44s} {'TTFT p50 s':>10s} {'TTFT mean s':>11s} {'tok/s':>8s} {'others':>7s}")
        for name, r in (
            (f"1 server x {cores} threads", one),
            (f"1 prefill + 1 decode x {max(1, cores // 2)} threads, router", pd),
        ):
            others = "-" if r["others"] is None else f"{r['others']:.2f}"
            print(f"{name:44s} {r['ttft_p50']:10.3f} {r['ttft_mean']:11.3f} {r['tok_s']:8.1f} {others:>7s}")
        print(
            f"P/D / 1 server: TTFT p50 {pd['ttft_p50'] / one['ttft_p50']:.2f}x, tok/s {pd['tok_s'] / one['tok_s']:.2f}x"
        )
        print(
            f"KV pulled: {nbytes / 1e6:.1f} MB for {moved['rlserve:kv_transfer_tokens_total']:.0f} prompt tokens in "
            f"{seconds:.3f} s of pulls (summed over concurrent pulls, each from the request reaching the decode "
            f"engine to its blocks usable there): {pulled / 1e9:.3f} GB/s, "
            f"{pulled / statistics.median(aged_rates):.2f}x the target's raw copy below; "
            f"decode fallbacks {fallbacks:.0f}"
        )
    lone_rate = statistics.median(lone_rates)
    print(
        f"{LONE_PULLS} transfers alone, {lone_bytes / 1e6:.1f} MB each, each followed by raw loopback socket copies "
        f"of its bytes ({block_bytes}-byte writes):"
    )
    print(f"  transfer: median {lone_rate / 1e9:.3f} GB/s (each: {', '.join(f'{r / 1e9:.2f}' for r in lone_rates)})")
    placed = (
        f"raw copy between two processes on the prefill and decode servers' cores "
        f"({','.join(map(str, sorted(p_cores)))} -> {','.join(map(str, sorted(d_cores)))}), {lone_bytes / 1e6:.1f} MB"
    )
    _ratio_lines(
        f"{placed} of KV (no framing), into memory laid out as the decode pool's blocks and untouched "
        "since the deployment started, as the free blocks the transfer lands in",
        lone_rates,
        aged_rates,
        target=True,
    )
    _ratio_lines(f"{placed}, into a buffer touched a moment before", lone_rates, placed_rates)
    _ratio_lines(
        f"raw copy in this process, unbound, into one reused {block_bytes}-byte buffer (cache-warm)",
        lone_rates,
        raw_rates,
    )
    _ratio_lines(
        f"raw copy in this process, unbound, between {lone_bytes / 1e6:.1f} MB buffers (memory-resident)",
        lone_rates,
        resident_rates,
    )
    first, again = (statistics.median(r[k] for r in idle_writes) for k in (0, 1))
    print(
        f"  the machine's memory: {PROBE_BYTES >> 20} MB untouched since the deployment started writes at "
        f"{first / 1e9:.2f} GB/s (each: {', '.join(f'{r[0] / 1e9:.2f}' for r in idle_writes)}), the same bytes "
        f"written again at {again / 1e9:.2f} GB/s (medians)"
    )
    if one is not None:
        print("others = CPU cores used by other processes during the run: well above 0 means the figures are low")


def _ratio_lines(what: str, transfers: list[float], raws: list[float], target: bool = False) -> None:
    ratios = sorted(t / r for t, r in zip(transfers, raws))
    median = statistics.median(raws)
    print(f"  {what}: median {median / 1e9:.3f} GB/s (each: {', '.join(f'{r / 1e9:.2f}' for r in raws)})")
    print(
        f"    transfer / that copy: {statistics.median(transfers) / median:.2f}x of the medians, pair by pair median "
        f"{statistics.median(ratios):.2f}x (min {ratios[0]:.2f}, max {ratios[-1]:.2f})"
        + ("; target >= 0.5x" if target else "")
    )


if __name__ == "__main__":
    main()
