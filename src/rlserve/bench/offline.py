"""`--peer offline`: rlserve's own engine without its HTTP server, measured as one more peer of
`rlserve bench serve --launch`, so that HTTP against offline is a ratio of the same run, taken in
turns with the server like every other. It is a process of its own (`python -m rlserve.bench.offline`
with `rlserve serve`'s config flags) holding an in-process Engine, driven as `rlserve bench
throughput` drives it: every request submitted at once. The benchmark reaches it over a loopback
control channel, one POST per workload; the timing happens inside, around the engine alone."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from types import SimpleNamespace

import httpx

from rlserve.bench.metrics import summarize


def run_remote(url: str, prompts: list[list[int]], opts) -> dict:
    """One workload on the offline peer at `url`: its summary, as run_level's for a server."""
    body = {"prompts": prompts, "output_len": opts.output_len, "n": getattr(opts, "n", 1),
            "temperature": opts.temperature, "logprobs": getattr(opts, "logprobs", None)}  # fmt: skip
    reply = httpx.post(f"{url}/run", json=body, timeout=None)
    if reply.status_code != 200:
        raise RuntimeError(f"the offline engine failed the workload: {reply.text[-2000:]}")
    return reply.json()


def _run_workload(engine, body: dict) -> dict:
    from rlserve.bench.throughput import run_engine

    logprobs = body.get("logprobs")
    args = SimpleNamespace(n=int(body.get("n", 1)), temperature=float(body["temperature"]), output_len=int(body["output_len"]),
                           seed=0, no_progress=True, logprobs=None if logprobs is None else int(logprobs))  # fmt: skip
    prompts = [[int(t) for t in p] for p in body["prompts"]]
    start = time.perf_counter()
    records = run_engine(engine, prompts, args)
    return summarize(records, time.perf_counter() - start, concurrency=len(prompts) * args.n)


def serve(engine, port: int) -> None:
    """Answer /health and POST /run on 127.0.0.1:port until SIGTERM; one workload at a time."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._reply(200, {"ok": True}) if self.path == "/health" else self._reply(404, {"error": self.path})

        def do_POST(self) -> None:
            if self.path != "/run":
                return self._reply(404, {"error": self.path})
            try:
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
                self._reply(200, _run_workload(engine, body))
            except Exception as exc:  # a benchmark's bug or a bad body: said, and the next one still runs
                self._reply(500, {"error": repr(exc)})

        def _reply(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:  # quiet: the benchmark prints what it measured
            pass

    httpd = HTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        httpd.serve_forever()
    finally:
        httpd.server_close()


def main(argv: list[str]) -> int:
    """`--port P` and `rlserve serve`'s --section.key flags (the model, its dtype, the KV pool, threads)."""
    from rlserve.config.load import load_config
    from rlserve.engine.engine import Engine

    parser = argparse.ArgumentParser(prog="python -m rlserve.bench.offline")
    parser.add_argument("--port", type=int, required=True)
    args, rest = parser.parse_known_args(argv)
    serve(Engine(load_config(rest)), args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
