"""The benchmark's load generator against a server that closes each connection after its response
without saying so (as llama-server does after a streamed response): sequential requests reuse the
pooled connection, and none may fail for it."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from rlserve.bench.serve import run_level


class _ClosingHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive implied; no Connection: close is sent

    def _send(self, body: bytes, content_type: str) -> None:
        self.send_response(200)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def do_GET(self) -> None:
        self._send(json.dumps({"data": [{"id": "stand-in"}]}).encode(), "application/json")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "usage": {"completion_tokens": 1}}
        self._send(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode(), "text/event-stream")

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def closing_server():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ClosingHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=30)


def test_sequential_requests_survive_a_server_that_closes_each_connection(closing_server):
    args = SimpleNamespace(
        model=None, output_len=1, temperature=1.0, no_stream=False, no_progress=True, timeout=60, n=1
    )
    run = asyncio.run(run_level(closing_server, 1, [[1, 2, 3]] * 6, args))
    assert run["failed"] == 0, run["errors"]
    assert run["requests"] == 6 and run["output_tokens"] == 6
