"""Per-request timings and their summary: tokens/s, requests/s, TTFT / ITL / latency percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestRecord:
    prompt_tokens: int
    output_tokens: int = 0
    latency: float = 0.0  # seconds from send to the last token
    ttft: float | None = None  # seconds to the first token (streaming and offline only)
    itl: list[float] = field(default_factory=list)  # gaps between token arrivals, seconds
    error: str | None = None


def percentiles(values: list[float]) -> dict[str, float] | None:
    """p50/p90/p99 and mean in milliseconds; None when there are no values."""
    if not values:
        return None
    arr = np.asarray(values) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration: float, concurrency: int | None) -> dict:
    """One benchmark run (one concurrency level) as a JSON-ready dict."""
    ok = [r for r in records if r.error is None]
    output = sum(r.output_tokens for r in ok)
    prompt = sum(r.prompt_tokens for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "prompt_tokens": prompt,
        "output_tokens": output,
        "requests_per_s": len(ok) / duration,
        "output_tokens_per_s": output / duration,
        "total_tokens_per_s": (output + prompt) / duration,
        "ttft_ms": percentiles([r.ttft for r in ok if r.ttft is not None]),
        "itl_ms": percentiles([gap for r in ok for gap in r.itl]),
        "latency_ms": percentiles([r.latency for r in ok]),
    }
