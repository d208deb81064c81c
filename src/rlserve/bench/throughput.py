"""The offline engine on a fixed workload: every request submitted at once (the concurrency is the
engine's own batch limit), timed per step as it streams tokens back."""

from __future__ import annotations

import time

from tqdm import tqdm

from rlserve.bench.metrics import RequestRecord, summarize
from rlserve.bench.serve import random_prompts
from rlserve.config.schema import Config
from rlserve.engine.engine import Engine
from rlserve.engine.params import SamplingParams


def run_engine(engine: Engine, prompts: list[list[int]], args, desc: str = "throughput") -> list[RequestRecord]:
    params = SamplingParams(
        n=args.n, temperature=args.temperature, max_tokens=args.output_len, ignore_eos=True, seed=args.seed,
        logprobs=getattr(args, "logprobs", None),
    )  # fmt: skip
    records: dict[str, RequestRecord] = {}
    last: dict[str, float] = {}
    bar = tqdm(total=len(prompts) * args.n * args.output_len, desc=desc, unit="tok", disable=args.no_progress)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"bench-{i}", prompt, params)
        records[f"bench-{i}"] = RequestRecord(prompt_tokens=len(prompt))
    while engine.has_unfinished():
        for out in engine.step():
            now, record = time.perf_counter(), records[out.request_id]
            produced = sum(len(c.token_ids) for c in out.outputs)
            if produced > record.output_tokens:
                if out.request_id in last:
                    record.itl.append(now - last[out.request_id])
                else:
                    record.ttft = now - start
                bar.update(produced - record.output_tokens)
                record.output_tokens, last[out.request_id] = produced, now
            if out.finished:
                record.latency = now - start
    bar.close()
    return list(records.values())


def run_throughput(args, config: Config) -> tuple[dict, list[dict]]:
    engine = Engine(config)
    vocab = min(args.vocab_size, engine.vocab_size)
    if args.warmup:
        run_engine(engine, random_prompts(1, args.prompt_len, vocab, args.seed - 1), _short(args), "warmup")
    prompts = random_prompts(args.num_prompts, args.prompt_len, vocab, args.seed)
    start = time.perf_counter()
    records = run_engine(engine, prompts, args)
    run = summarize(records, time.perf_counter() - start, concurrency=len(prompts) * args.n)
    meta = {
        "kind": "throughput", "model": str(engine.model_dir), "dtype": str(engine.dtype).removeprefix("torch."),
        "device": str(engine.device), "prompt_len": args.prompt_len, "output_len": args.output_len, "n": args.n,
        "temperature": args.temperature,
    }  # fmt: skip
    return meta, [run]


def _short(args):
    import copy

    short = copy.copy(args)
    short.output_len, short.n, short.no_progress = 4, 1, True
    return short
