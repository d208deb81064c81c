"""vLLM 0.32's Prometheus families beyond the core set (server/metrics.py), where rlserve has the same event:
per-request phase times and request parameters, tokens per engine step, waiting requests by reason, and the
RL weight-transfer and sleep-mode operations (their duration and how many are in flight)."""

from __future__ import annotations

import time
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CollectorRegistry, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.engine.stats import ITERATION_TOKENS_BUCKETS
from rlserve.server.auth import route_path

PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
OPERATION_BUCKETS = (0.01, 0.1, 1, 10, 30, 60, 120, 300, 600)
WEIGHT_OPERATIONS = {
    "/init_weight_transfer_engine": "init",
    "/shutdown_weight_transfer_engine": "shutdown",
    "/start_weight_update": "start",
    "/update_weights": "update",
    "/finish_weight_update": "finish",
}
SLEEP_OPERATIONS = {"/sleep": "sleep", "/release_kv_cache_memory": "release_kv_cache_memory", "/wake_up": "wake"}


class RequestPhases:
    """vllm:request_{queue,prefill,decode,inference}_time_seconds and vllm:request_params_{n,max_tokens}.
    Queue time is the engine's (arrival to first scheduled); prefill is the rest of the time to the first token,
    decode the first to the last token, inference prefill plus decode."""

    def __init__(self, registry: CollectorRegistry, labels: tuple[str, ...], latency_buckets, token_buckets):
        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.queue = histogram(
            "vllm:request_queue_time_seconds", "Time spent waiting to be scheduled.", latency_buckets
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds", "Scheduled to first token (prefill).", latency_buckets
        )
        self.decode = histogram("vllm:request_decode_time_seconds", "First token to last token.", latency_buckets)
        self.inference = histogram(
            "vllm:request_inference_time_seconds", "Scheduled to last token (prefill + decode).", latency_buckets
        )
        self.params_n = histogram("vllm:request_params_n", "The n request parameter.", PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "The max_tokens request parameter (resolved).", token_buckets
        )

    def touch(self, labels: dict[str, str]) -> None:
        """Every engine's series exists from the start (vLLM shows them at zero)."""
        for h in (self.queue, self.prefill, self.decode, self.inference, self.params_n, self.params_max_tokens):
            h.labels(**labels)

    def observe(
        self,
        labels: dict[str, str],
        params: SamplingParams | None,
        out: RequestOutput | None,
        times: tuple[float, float | None, float | None],
        max_model_len: int,
    ) -> None:
        """`times`: (submitted, first token, last token), monotonic, as the server saw them."""
        if out is None or params is None:
            return
        start, first, last = times
        self.params_n.labels(**labels).observe(params.n)
        room = max_model_len - len(out.prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.params_max_tokens.labels(**labels).observe(max_tokens)
        if first is None or last is None:
            return  # aborted before its first token: no phases to tell
        queue = min(out.queue_seconds or 0.0, first - start)
        prefill, decode = first - start - queue, last - first
        self.queue.labels(**labels).observe(queue)
        self.prefill.labels(**labels).observe(prefill)
        self.decode.labels(**labels).observe(decode)
        self.inference.labels(**labels).observe(prefill + decode)


def engine_families(stats: Any, names: list[str], values: list[str], sleep: tuple[bool, int]):
    """Families read from one engine's stats at scrape time."""
    hist = HistogramMetricFamily(
        "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=names
    )
    counts = stats.iteration_tokens or [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
    cumulative, running = [], 0
    for bound, count in zip((*ITERATION_TOKENS_BUCKETS, float("inf")), counts):
        running += count
        cumulative.append((str(float(bound)) if bound != float("inf") else "+Inf", running))
    hist.add_metric(values, cumulative, sum_value=stats.iteration_tokens_sum)
    yield hist
    waiting = GaugeMetricFamily(
        "vllm:num_requests_waiting_by_reason",
        "Waiting requests by reason: capacity (waiting for room in the batch or KV cache); deferred (none here).",
        labels=names + ["reason"],
    )
    waiting.add_metric(values + ["capacity"], stats.num_waiting)
    waiting.add_metric(values + ["deferred"], 0)
    yield waiting
    sleeping, level = sleep
    state = GaugeMetricFamily(
        "vllm:engine_sleep_state",
        "Engine sleep state: awake 1 when awake; weights_offloaded 1 at sleep level 1; discard_all 1 at level 2.",
        labels=names + ["sleep_state"],
    )
    for name, on in (
        ("awake", not sleeping),
        ("weights_offloaded", sleeping and level == 1),
        ("discard_all", sleeping and level == 2),
    ):
        state.add_metric(values + [name], float(on))
    yield state


class OperationMetrics:
    """vllm:rl_weight_update_operation_* and vllm:sleep_mode_operation_* (duration, in flight), per operation;
    `sleep` (sleeping, level) follows the last successful /sleep and /wake_up."""

    def __init__(self, registry: CollectorRegistry):
        self.sleep = (False, 0)
        self.families = {}
        for kind, doc in (("rl_weight_update", "weight-transfer"), ("sleep_mode", "sleep-mode")):
            self.families[kind] = (
                Histogram(
                    f"vllm:{kind}_operation_duration_seconds",
                    f"Duration of one {doc} operation.",
                    ["operation"],
                    buckets=OPERATION_BUCKETS,
                    registry=registry,
                ),
                Gauge(
                    f"vllm:{kind}_operations_in_flight",
                    f"{doc} operations currently awaited.",
                    ["operation"],
                    registry=registry,
                ),
            )

    def family(self, path: str) -> tuple[str, str] | None:
        if path in WEIGHT_OPERATIONS:
            return "rl_weight_update", WEIGHT_OPERATIONS[path]
        if path in SLEEP_OPERATIONS:
            return "sleep_mode", SLEEP_OPERATIONS[path]
        return None


class OperationTimer:
    """Times the weight-transfer and sleep routes into OperationMetrics (the app's Metrics.operations)."""

    def __init__(self, app: ASGIApp, operations: OperationMetrics):
        self.app, self.ops = app, operations

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        found = self.ops.family(route_path(scope).rstrip("/")) if scope["type"] == "http" else None
        if found is None or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        kind, operation = found
        duration, in_flight = self.ops.families[kind]
        status = 0

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        in_flight.labels(operation).inc()
        started = time.perf_counter()
        try:
            await self.app(scope, receive, watch)
        finally:
            in_flight.labels(operation).dec()
            duration.labels(operation).observe(time.perf_counter() - started)
        if status == 200 and kind == "sleep_mode":
            self._sleep_state(operation, scope.get("query_string", b"").decode("latin-1"))

    def _sleep_state(self, operation: str, query: str) -> None:
        args = parse_qs(query)
        if operation == "sleep":
            level = (args.get("level") or ["1"])[0]
            self.ops.sleep = (True, int(level) if level.isdigit() else 1)
        elif operation == "wake" and (not args.get("tags") or {"weights", "kv_cache"} <= set(args["tags"])):
            self.ops.sleep = (False, 0)
