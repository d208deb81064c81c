"""Prometheus metrics under vLLM's names (docs/protocols.md §2.12), one registry per app.

Engine gauges and counters are read from `engine.stats` at scrape time; request histograms are
observed by the server as outputs stream by.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from rlserve.engine.outputs import RequestOutput
from rlserve.engine.params import SamplingParams
from rlserve.runtime.data_parallel import served_by
from rlserve.runtime.face import EngineFace
from rlserve.server.metrics_vllm import OperationMetrics, RequestPhases, engine_families


def weight_version(engine: EngineFace) -> str:
    """The trainer-owned label (§2.15); "default" until weight updates set one on the engine."""
    return engine.weight_version or "default"


def wants_json_metrics(request, default_format: str) -> bool:
    """GET /metrics: ?format=json|prometheus, else the Accept header (Prometheus/OpenMetrics text for scrapers,
    application/json for the MLX-style JSON), else server.metrics_format (a plain GET, Accept */*)."""
    fmt = request.query_params.get("format")
    if fmt in ("json", "prometheus"):
        return fmt == "json"
    accept = request.headers.get("accept", "").lower()
    if "openmetrics-text" in accept or "text/plain" in accept:
        return False
    return "application/json" in accept or default_format == "json"


LABELS = ("model_name", "engine")
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


def token_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's request-length buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


class Metrics:
    """Per-request series carry the `engine` label of the engine core that served the request (parallel.dp)."""

    def __init__(self, engine: EngineFace, model_name: str):
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        self.labels = {"model_name": model_name, "engine": "0"}
        reg, labels = self.registry, LABELS
        limit = engine.max_model_len
        self.request_success = Counter(
            "vllm:request_success", "Finished requests by finish reason.", (*labels, "finished_reason"), registry=reg
        )
        self._prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens of requests (cached ones included).", labels, registry=reg
        )
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", labels, buckets=TTFT_BUCKETS, registry=reg
        )
        self._itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between two output steps.",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds", "Arrival to last token.", labels, buckets=E2E_BUCKETS, registry=reg
        )
        self._request_prompt_tokens = Histogram(
            "vllm:request_prompt_tokens",
            "Prompt length per request.",
            labels,
            buckets=token_buckets(limit),
            registry=reg,
        )
        self._request_generation_tokens = Histogram(
            "vllm:request_generation_tokens",
            "Generated tokens per sample.",
            labels,
            buckets=token_buckets(limit),
            registry=reg,
        )
        self.max_model_len = limit
        self.phases = RequestPhases(reg, labels, E2E_BUCKETS, token_buckets(limit))
        self.operations = OperationMetrics(reg)
        self._series: dict[int, EngineSeries] = {}
        for index in range(len(getattr(engine, "engines", [engine]))):
            self.series(index)  # every engine's series present from the start, as in vLLM
        reg.register(_EngineCollector(engine, self.labels, self.operations))

    def series(self, index: int) -> EngineSeries:
        """The per-request series of engine `index`."""
        found = self._series.get(index)
        if found is None:
            labels = {"model_name": self.model_name, "engine": str(index)}
            for reason in ("stop", "length", "abort"):
                self.request_success.labels(**labels, finished_reason=reason)
            self.phases.touch(labels)
            found = self._series[index] = EngineSeries(
                labels,
                self._prompt_tokens.labels(**labels),
                self._ttft.labels(**labels),
                self._itl.labels(**labels),
                self._e2e.labels(**labels),
                self._request_prompt_tokens.labels(**labels),
                self._request_generation_tokens.labels(**labels),
            )
        return found

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self, params: SamplingParams | None = None) -> RequestTimer:
        return RequestTimer(self, params)


@dataclass(slots=True)
class EngineSeries:
    labels: dict[str, str]
    prompt_tokens: Any
    ttft: Any
    itl: Any
    e2e: Any
    request_prompt_tokens: Any
    request_generation_tokens: Any


class RequestTimer:
    """Latency and length observations of one engine request, fed its cumulative outputs; observed under the
    engine that served it (data_parallel.served_by, set in the timer's task once the engine is picked)."""

    def __init__(self, metrics: Metrics, params: SamplingParams | None = None):
        self.metrics, self.params = metrics, params
        self.start = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.num_tokens = 0

    @property
    def m(self) -> EngineSeries:
        return self.metrics.series(served_by.get())

    def step(self, out: RequestOutput) -> None:
        tokens = sum(len(o.token_ids) for o in out.outputs)
        if tokens <= self.num_tokens:
            return
        now = time.monotonic()
        if self.last_token_time is None:
            self.first_token_time = now
            self.m.ttft.observe(now - self.start)
            self.m.prompt_tokens.inc(len(out.prompt_token_ids))
        else:
            # non-streamed requests only see their first and last output: spread the gap evenly
            steps = max(1, round((tokens - self.num_tokens) / max(1, len(out.outputs))))
            for _ in range(steps):
                self.m.itl.observe((now - self.last_token_time) / steps)
        self.last_token_time, self.num_tokens = now, tokens

    def end(self, out: RequestOutput | None, n: int) -> None:
        """`out` is the last output seen (None if none arrived); unfinished samples count as aborts."""
        m = self.m
        m.e2e.observe(time.monotonic() - self.start)
        times = (self.start, self.first_token_time, self.last_token_time)
        self.metrics.phases.observe(m.labels, self.params, out, times, self.metrics.max_model_len)
        if out is not None:
            m.request_prompt_tokens.observe(len(out.prompt_token_ids))
        outputs = out.outputs if out is not None else []
        for i in range(n):
            o = outputs[i] if i < len(outputs) else None
            m.request_generation_tokens.observe(len(o.token_ids) if o else 0)
            reason = (o.finish_reason if o else None) or "abort"
            self.metrics.request_success.labels(**m.labels, finished_reason=reason).inc()


class _EngineCollector(Collector):
    def __init__(self, engine: EngineFace, labels: dict[str, str], operations: OperationMetrics):
        self.engine, self.labels, self.operations = engine, labels, operations

    def collect(self):
        # one family per name, with one sample per engine core (parallel.dp) labelled engine="i": the text
        # format allows a family's HELP and TYPE once
        families: dict[str, Any] = {}
        for i, engine in enumerate(getattr(self.engine, "engines", [self.engine])):
            for family in self._collect(engine, {**self.labels, "engine": str(i)}):
                if family.name in families:
                    families[family.name].samples.extend(family.samples)
                else:
                    families[family.name] = family
        yield from families.values()

    def _collect(self, engine, labels: dict[str, str]):
        s = engine.stats
        names, values = list(labels), list(labels.values())

        def gauge(name: str, doc: str, value: float, **extra: str) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names + list(extra))
            g.add_metric(values + list(extra.values()), value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        yield gauge("vllm:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1).", s.kv_cache_usage)
        yield gauge(
            "vllm:cache_config_info",
            "KV-cache configuration.",
            1,
            block_size=str(s.block_size),
            num_gpu_blocks=str(s.num_blocks),
            kv_cache_size_tokens=str(s.num_blocks * s.block_size),
            enable_prefix_caching=str(self.engine.config.engine.enable_prefix_caching),
        )
        yield counter("vllm:num_preemptions", "Preempted sequences.", s.num_preemptions)
        yield counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield counter("vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", s.prefix_cache_hits)
        yield counter("vllm:generation_tokens", "Generated tokens.", s.generation_tokens)
        yield counter(
            "rlserve:prompt_tokens_computed", "Prompt tokens run through the model.", s.prompt_tokens_computed
        )
        yield gauge("rlserve:policy_version", "Policy version of the served weights.", s.policy_version)
        yield gauge(
            "rlserve:weight_version_info",
            "Trainer-owned weight version label.",
            1,
            weight_version=weight_version(engine),
        )
        yield gauge("rlserve:is_paused", "1 while generation is paused.", float(engine.paused))
        yield from engine_families(s, names, values, self.operations.sleep)
        yield from _offload_metrics(s, names, values)
        yield from _transfer_metrics(s, names, values)
        yield from _expert_metrics(s, names, values)


def _expert_metrics(s, names: list[str], values: list[str]):
    """Expert parallelism's load: per rank and per logical expert (all sparse layers), rebalances."""
    if not s.ep_rank_load:
        return
    for name, doc, label, loads in (
        (
            "rlserve:ep_rank_load",
            "Token-expert assignments each expert-parallel rank computed.",
            "ep_rank",
            s.ep_rank_load,
        ),
        (
            "rlserve:ep_expert_load",
            "Token-expert assignments routed to each logical expert.",
            "expert",
            s.ep_expert_load,
        ),
    ):
        m = CounterMetricFamily(name, doc, labels=names + [label])
        for i, load in enumerate(loads):
            m.add_metric(values + [str(i)], load)
        yield m
    total = sum(s.ep_rank_load)
    share = GaugeMetricFamily(
        "rlserve:ep_busiest_rank_share",
        "The busiest rank's share of all assignments (1/ranks = balanced).",
        labels=names,
    )
    share.add_metric(values, max(s.ep_rank_load) / total if total else 0.0)
    yield share
    for name, doc, value in (
        ("rlserve:eplb_rebalances", "Expert re-placements by the load balancer.", s.eplb_rebalances),
        ("rlserve:ep_all_to_all_seconds", "Seconds rank 0 spent in expert all-to-alls.", s.ep_all_to_all_seconds),
        ("rlserve:ep_all_to_alls", "Expert all-to-alls rank 0 started.", s.ep_all_to_alls),
    ):
        m = CounterMetricFamily(name, doc, labels=names)
        m.add_metric(values, value)
        yield m


def _offload_metrics(s, names: list[str], values: list[str]):
    """KV offload tiers, one label per tier or direction; zeros without offload."""

    def family(kind, name: str, doc: str, label: str, points: dict[str, float]):
        m = kind(name, doc, labels=names + [label])
        for key, value in points.items():
            m.add_metric(values + [key], value)
        return m

    yield family(
        CounterMetricFamily,
        "rlserve:kv_offload_queries",
        "Prompt tokens looked up in an offload tier.",
        "tier",
        {"cpu": s.kv_offload_cpu_queries, "disk": s.kv_offload_disk_queries, "mooncake": s.kv_offload_mooncake_queries},
    )
    yield family(
        CounterMetricFamily,
        "rlserve:kv_offload_hits",
        "Prompt tokens loaded from an offload tier.",
        "tier",
        {"cpu": s.kv_offload_cpu_hits, "disk": s.kv_offload_disk_hits, "mooncake": s.kv_offload_mooncake_hits},
    )
    yield family(
        CounterMetricFamily,
        "rlserve:kv_offload_bytes",
        "KV bytes moved between the pool and the tiers.",
        "direction",
        {
            "pool_to_cpu": s.kv_offload_bytes_to_cpu,
            "cpu_to_pool": s.kv_offload_bytes_from_cpu,
            "cpu_to_disk": s.kv_offload_bytes_to_disk,
            "disk_to_pool": s.kv_offload_bytes_from_disk,
            "pool_to_mooncake": s.kv_offload_bytes_to_mooncake,
            "mooncake_to_pool": s.kv_offload_bytes_from_mooncake,
        },
    )
    yield family(
        GaugeMetricFamily,
        "rlserve:kv_offload_usage_bytes",
        "Bytes of KV held by an offload tier.",
        "tier",
        {"cpu": s.kv_offload_cpu_used_bytes, "disk": s.kv_offload_disk_used_bytes},
    )
    yield family(
        GaugeMetricFamily,
        "rlserve:kv_offload_capacity_bytes",
        "Size of the CPU offload tier.",
        "tier",
        {"cpu": s.kv_offload_cpu_capacity_bytes},
    )
    c = CounterMetricFamily(
        "rlserve:kv_offload_rejected_blocks", "Disk blocks failing their checksum (recomputed).", labels=names
    )
    c.add_metric(values, s.kv_offload_disk_rejected)
    yield c


def _transfer_metrics(s, names: list[str], values: list[str]):
    """Prefill/decode KV transfer (engine/kv/transfer.py); zeros without kv_transfer."""

    def family(kind, name: str, doc: str, points: dict[str, float]):
        m = kind(name, doc, labels=names + ["direction"])
        for key, value in points.items():
            m.add_metric(values + [key], value)
        return m

    def single(kind, name: str, doc: str, value: float):
        m = kind(name, doc, labels=names)
        m.add_metric(values, value)
        return m

    yield family(
        CounterMetricFamily,
        "rlserve:kv_transfers",
        "KV transfers: pulled into this pool (in) or served to a decode server (out).",
        {"in": s.kv_transfer_pulls, "out": s.kv_transfer_serves},
    )
    yield family(
        CounterMetricFamily,
        "rlserve:kv_transfer_bytes",
        "KV bytes pulled (in) or served (out).",
        {"in": s.kv_transfer_bytes_in, "out": s.kv_transfer_bytes_out},
    )
    yield family(
        CounterMetricFamily,
        "rlserve:kv_transfer_seconds",
        "Seconds from a pull's start to its blocks usable in the pool (in), or serving pulls (out).",
        {"in": s.kv_transfer_seconds_in, "out": s.kv_transfer_seconds_out},
    )
    yield single(
        CounterMetricFamily,
        "rlserve:kv_transfer_tokens",
        "Prompt tokens whose KV was pulled, not computed.",
        s.kv_transfer_tokens_in,
    )
    yield single(
        CounterMetricFamily,
        "rlserve:kv_transfer_failures",
        "KV pulls that failed (then prefilled locally).",
        s.kv_transfer_pull_failures,
    )
    yield single(
        CounterMetricFamily,
        "rlserve:kv_transfer_local_fallbacks",
        "Remote-prefill requests prefilled "
        "locally: weight generation, dtype, block size or shape mismatch, or a failed pull.",
        s.kv_transfer_fallbacks,
    )
    yield single(
        CounterMetricFamily,
        "rlserve:kv_transfer_skipped",
        "Remote-prefill requests prefilled locally because fewer than non_cached_tokens prompt tokens were missing.",
        s.kv_transfer_skipped,
    )
    yield single(
        CounterMetricFamily,
        "rlserve:kv_transfer_expired",
        "Pinned transfers freed by the timeout.",
        s.kv_transfer_expired,
    )
    yield single(
        GaugeMetricFamily,
        "rlserve:kv_transfer_pinned_blocks",
        "KV blocks pinned for decode servers.",
        s.kv_transfer_pinned_blocks,
    )
