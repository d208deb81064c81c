"""`rlserve bench throughput|serve`: argument parsing, and the table / JSON / PNG at the end."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlserve.bench.report import plot, table, write_json


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt (random ids)")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per request (EOS ignored)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--vocab-size", type=int, default=1000, help="prompt token ids are drawn below this")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-warmup", dest="warmup", action="store_false", help="skip the untimed warm-up request")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", type=Path, help="write the results as JSON here")
    p.add_argument("--plot", type=Path, help="write a PNG plot here (needs matplotlib: pip install 'rlserve[bench]')")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlserve bench", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser(
        "throughput",
        help="the offline engine",
        description="The offline engine on random prompts; any other --section.key VALUE (or @ FILE) "
        "configures the engine as for `rlserve serve`, e.g. --model.dtype bfloat16.",
    )
    t.add_argument("--num-prompts", type=int, default=8)
    t.add_argument("--n", type=int, default=8, help="samples per prompt (they share the prompt's KV)")
    _common(t)
    s = sub.add_parser("serve", help="a running server or deployment, over HTTP")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="one run per level")
    s.add_argument("--num-prompts", type=int, help="requests per level (default: 4 x concurrency)")
    s.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT/ITL then)")
    s.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", help="Bearer key, when the server requires one")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    _common(s)
    return p


def main(argv: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.command == "serve":
        if rest:
            parser().error(f"unrecognized arguments: {' '.join(rest)}")
        from rlserve.bench.serve import run_serve

        meta, runs = run_serve(args)
        title = f"rlserve bench serve {args.base_url}"
    else:
        from rlserve.config.load import ConfigError, load_config

        try:
            config = load_config(rest)
        except ConfigError as e:
            print(f"rlserve bench throughput: error: {e}", file=sys.stderr)
            return 2
        from rlserve.bench.throughput import run_throughput

        meta, runs = run_throughput(args, config)
        title = f"rlserve bench throughput ({meta['dtype']}, {meta['device']})"
    print(f"\n{title}: prompt {args.prompt_len} + {args.output_len} new tokens, temperature {args.temperature}")
    print(table(runs))
    if args.json:
        write_json(args.json, meta, runs)
        print(f"wrote {args.json}")
    if args.plot:
        plot(args.plot, title, runs)
        print(f"wrote {args.plot}")
    return 1 if any(r["failed"] for r in runs) else 0
