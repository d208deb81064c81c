"""Structured outputs: 64 concurrent constrained requests against 64 unconstrained ones, same engine, same run.

    python benchmarks/structured.py             # smollm2-135m shape (vocabulary 49,152), 64 x 64 tokens
    python benchmarks/structured.py --quick     # the tiny model, 8 x 16 tokens

Workloads (each a fresh set of random prompts, all submitted at once so they share every step):
- `free`: no constraint, EOS ignored, exactly --new-tokens tokens each;
- `json-long`: a JSON schema whose one string field is longer than the budget, so every sequence is
  masked at every step and also generates exactly --new-tokens tokens (the per-step mask cost, like for like);
- `json-mixed`: half the requests under a small closing schema, half free (constrained and free rows
  in one batch; constrained rows stop when their object closes).
Grammar compile time is measured apart, cold, per schema: validation (the API process) and the compile
(the engine's thread pool), before any generation.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _cpu import OtherLoad
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams
from rlserve.engine.structured import CHECKED, StructuredOutputs
from rlserve.model.make import bench_cache_dir, default_model_dir, make_model

LONG = {
    "type": "object",
    "required": ["text"],
    "additionalProperties": False,
    "properties": {"text": {"type": "string", "minLength": 4000}},
}
SMALL = {
    "type": "object",
    "additionalProperties": False,
    "required": ["answer", "score", "tags"],
    "properties": {
        "answer": {"enum": ["yes", "no", "unsure"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 100},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 6}},
    },
}
TOOLISH = {
    "type": "object",
    "required": ["name", "arguments"],
    "additionalProperties": False,
    "properties": {
        "name": {"const": "search"},
        "arguments": {
            "type": "object",
            "required": ["query", "k"],
            "properties": {"query": {"type": "string"}, "k": {"type": "integer"}},
        },
    },
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per workload; the fastest is kept")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.preset, args.requests, args.new_tokens, args.repeats = "tiny", 8, 16, 1
    return args


def compile_times(engine: Engine) -> list[tuple[str, float, float]]:
    """(schema, validation in the API process, compile on the engine's pool) in seconds, cold."""
    out = []
    for name, schema in (("long-string", LONG), ("small-object", SMALL), ("tool-call", TOOLISH)):
        fresh = StructuredOutputs(engine.tokenizer, engine.vocab_size, engine.eos_token_ids)
        fresh.checker.tokenizer()  # the vocabulary's trie is built once per process, not per grammar
        t0 = time.perf_counter()
        grammar = fresh.checker.grammar({"json": schema})
        t1 = time.perf_counter()
        fresh.matcher_for(fresh.check({CHECKED: grammar}, None))
        out.append((name, t1 - t0, time.perf_counter() - t1))
        fresh.close()
    return out


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[int, float]:
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params)
    seconds = time.perf_counter() - t0
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    model_dir = (
        default_model_dir() if args.preset == "tiny" else make_model(args.preset, bench_cache_dir() / args.preset)
    )
    cfg = Config()
    cfg.model.name = str(model_dir)
    cfg.model.max_model_len = 512
    cfg.engine.max_num_seqs = max(args.requests, cfg.engine.max_num_seqs)
    engine = Engine(cfg)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:
        return [[rng.randrange(engine.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.requests)]

    def params(spec: dict | None, free: bool) -> SamplingParams:
        return SamplingParams(
            temperature=1.0,
            max_tokens=args.new_tokens,
            seed=rng.randrange(1 << 30),
            ignore_eos=free,
            structured_outputs=spec,
        )

    print(
        f"model {args.preset} (vocabulary {engine.vocab_size}), {args.requests} concurrent requests, "
        f"prompt {args.prompt_len} tokens, up to {args.new_tokens} new tokens, grammar engine llguidance"
    )
    print(
        "\ngrammar compile (cold, one schema on a fresh compiler): validation in the API process, compile on the "
        "engine's thread pool"
    )
    for name, validate, compile_ in compile_times(engine):
        print(f"  {name:<14} validate {validate * 1e3:8.2f} ms   compile {compile_ * 1e3:8.2f} ms")
    workloads = {
        "free": lambda: [params(None, True) for _ in range(args.requests)],
        "json-long": lambda: [params({"json": LONG}, False) for _ in range(args.requests)],
        "json-mixed": lambda: [
            params({"json": SMALL}, False) if i % 2 else params(None, True) for i in range(args.requests)
        ],
    }
    run(engine, prompts()[:2], [params({"json": SMALL}, False), params(None, True)])  # warm-up, compiles SMALL
    run(engine, prompts()[:2], [params({"json": LONG}, False)] * 2)
    print(f"\n{'workload':<12} {'tokens':>7} {'seconds':>8} {'tok/s':>8} {'vs free':>8} {'others':>7}")
    free_rate = None
    for name, make in workloads.items():
        best = None
        for _ in range(args.repeats):
            with OtherLoad() as load:
                tokens, seconds = run(engine, prompts(), make())
            others = load.cores if load.cores is not None else float("nan")
            if best is None or tokens / seconds > best[0] / best[1]:
                best = (tokens, seconds, others)
        tokens, seconds, others = best
        rate = tokens / seconds
        free_rate = free_rate or rate
        print(f"{name:<12} {tokens:>7} {seconds:>8.2f} {rate:>8.1f} {rate / free_rate:>7.2f}x {others:>7.2f}")
    print("\n`others`: CPU cores other processes used during the run; well above 0 means a noisy figure.")
    engine.close()


if __name__ == "__main__":
    main()
