"""Qwen3-MoE generation throughput (rlserve with router replay on, against transformers
`generate_batch`, in one run) and the size of the routed_experts payload per token.

    python benchmarks/moe.py            # qwen3-30b-a3b-mini: 4 prompts x n=4, 32 prompt + 32 new tokens
    python benchmarks/moe.py --quick    # tiny-moe, small counts: a smoke test

Payload: rlserve's §2.14 JSON object (base64 of raw uint8 rows) against vLLM's form, the base64 of
an `.npy` file (np.save) of the same rows; vLLM's capture buffers hold int32 ids, shown beside a
uint8 `.npy` for the format alone.
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import warnings
from pathlib import Path

import numpy as np
import torch
import transformers

import throughput
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.engine.routing import encode_routed_experts
from rlserve.model.make import bench_cache_dir, make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3-30b-a3b-mini")
    p.add_argument("--batch-prompts", type=int, default=4)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--cache-dir", type=Path, default=bench_cache_dir())
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.batch_prompts, args.n, args.prompt_len, args.new_tokens = "tiny-moe", 2, 2, 16, 8
    return args


def npy_base64(rows: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, rows)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message="The `paged|` prefix")
    model_dir = make_model(args.preset, args.cache_dir / args.preset)
    cfg_json = json.loads((model_dir / "config.json").read_text())
    warmup, timed = throughput.make_workloads(args, cfg_json["vocab_size"])
    timed = timed[:1]  # the batch workload
    print(
        f"model {args.preset} (random weights, fp32): {cfg_json['num_experts']} experts, top-{cfg_json['num_experts_per_tok']}, "
        f"{cfg_json['num_hidden_layers']} layers; {args.batch_prompts} prompts x n={args.n}, {args.prompt_len} prompt + "
        f"{args.new_tokens} new tokens, temperature 1, EOS ignored; {args.threads} threads"
    )

    cfg = Config(num_threads=args.threads, seed=args.seed, enable_return_routed_experts=True)
    cfg.model.name, cfg.model.max_model_len = str(model_dir), max(512, timed[0].max_len)
    cfg.engine.kv_cache_bytes = throughput.kv_bytes_for(
        model_dir, timed, cfg.engine.block_size, cfg.model.max_model_len, "float32"
    )
    engine = Engine(cfg)
    outputs = []

    def run(w: throughput.Workload) -> int:
        params = SamplingParams(n=w.n, temperature=1.0, max_tokens=w.new_tokens, ignore_eos=True, seed=args.seed)
        outputs[:] = engine.generate(w.prompts, params)
        return sum(len(c.token_ids) for o in outputs for c in o.outputs)

    results = throughput.measure("rlserve (router replay on)", run, warmup, timed, args.repeats, "float32")
    rows = [c.routed_experts for o in outputs for c in o.outputs]
    engine = run = None  # frees the engine before the next one
    gc.collect()
    results += throughput.measure(
        throughput.GENERATE_BATCH,
        throughput.generate_batch_runner(model_dir, args, "float32"),
        warmup,
        timed,
        args.repeats,
        "float32",
    )
    ours = results[0]
    print(f"\n{'system':<30} {'seqs':>5} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'rlserve/x':>10} {'others':>7}")
    for r in results:
        ratio = "" if r is ours else f"{ours.tok_s / r.tok_s:.1f}x"
        others = "" if r.others is None else f"{r.others:.2f}"
        print(f"{r.system:<30} {r.seqs:>5} {r.tokens:>7} {r.seconds:>8.2f} {r.tok_s:>8.1f} {ratio:>10} {others:>7}")
    print(f"others = CPU cores used by other processes during the run (of {os.cpu_count()})")

    positions = sum(r.shape[0] for r in rows)
    forms = {
        "rlserve §2.14 (base64 raw uint8)": sum(len(json.dumps(encode_routed_experts(r, 0))) for r in rows),
        "vLLM base64 .npy, int32": sum(len(json.dumps(npy_base64(r.astype(np.int32)))) for r in rows),
        "vLLM base64 .npy, uint8": sum(len(json.dumps(npy_base64(r))) for r in rows),
    }
    print(
        f"\nrouted_experts payload, JSON bytes per forwarded position ({positions} positions, {len(rows)} sequences, "
        f"rows of {rows[0].shape[1]} layers x top-{rows[0].shape[2]}):"
    )
    base = forms["rlserve §2.14 (base64 raw uint8)"]
    for name, size in forms.items():
        print(f"  {name:<36} {size / positions:8.1f}  ({size / base:.2f}x rlserve)")


if __name__ == "__main__":
    main()
