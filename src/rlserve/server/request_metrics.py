"""vLLM's per-request `metrics` in answers (`server.enable_per_request_metrics`, vLLM's
--enable-per-request-metrics): the timing of one generation stream, read from the server's clock (the
request's RequestTimer, server/metrics.py) and the engine's queue time. As in vLLM, only a request of one
prompt with n=1 gets them: the timings of several prompts or samples are not one stream's."""

from __future__ import annotations

from rlserve.server.metrics import RequestTimer

FIELDS = ("time_to_first_token_ms", "generation_time_ms", "queue_time_ms", "mean_itl_ms", "tokens_per_second")


def timing(timer: RequestTimer, queue_seconds: float | None) -> dict[str, float | None]:
    """vLLM's definitions: time to first token counts from the first scheduling (after the queue), generation
    time from the first token to the last, tokens per second over scheduling to the last token; a field whose
    moments are unknown is None."""
    out: dict[str, float | None] = dict.fromkeys(FIELDS)
    first, last = timer.first_token_time, timer.last_token_time
    if queue_seconds is not None:
        # the engine's arrival comes a little after the server's start: bound it by what the server saw
        queue_seconds = min(queue_seconds, (first or timer.start) - timer.start)
        out["queue_time_ms"] = queue_seconds * 1000
    if first is None or last is None:
        return out
    scheduled = timer.start + (queue_seconds or 0.0)
    out["time_to_first_token_ms"] = (first - scheduled) * 1000
    out["generation_time_ms"] = (last - first) * 1000
    if timer.num_tokens > 1:
        out["mean_itl_ms"] = (last - first) / (timer.num_tokens - 1) * 1000
    if last > scheduled:
        out["tokens_per_second"] = timer.num_tokens / (last - scheduled)
    return out
