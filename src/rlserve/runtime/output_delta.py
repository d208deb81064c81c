"""A request's outputs cross the engine boundary as what is new since its last message.

The engine hands back cumulative outputs (every token, logprob and character so far), and the
server's routes want them so. Sent whole every step, a request of P prompt and L generated tokens
costs O(P + L) to encode and decode per step, O(L * (P + L)) over its life: at 64 requests of
4,096 + 512 tokens with logprobs, 12 ms of the API process's decoding per engine step. So the core
sends each list from where the server's copy ends (`trim`) and the prompt's fields once, and the
client rebuilds the cumulative output from its last one (`merge`); the routes see what they saw.

Lists only grow while a request runs. Where one did not (a text that is not an extension of the
one sent, logprob lists out of step with the tokens), the sample is sent whole from offset 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlserve.engine.outputs import CompletionOutput, RequestOutput


@dataclass(slots=True)
class Sent:
    """What the server already holds of one stream (kept by the engine core)."""

    messages: int = 0
    prompt: bool = False  # its prompt fields, final (a sample had a token)
    samples: dict[int, tuple[int, str]] = field(default_factory=dict)  # index -> (tokens, text)


# per sample: the token offset its lists continue from, and the text offset its text continues from
Starts = list[tuple[int, int]]


def trim(out: RequestOutput, sent: Sent) -> tuple[RequestOutput, Starts, bool]:
    """`out` cut down, in place, to the tail the server lacks; its samples' starts; and whether the
    prompt's fields were left out (the server has them). `out` must be the engine's fresh output of
    this step (Request.output() builds new objects), which nothing else holds; `sent` is brought up
    to date."""
    prompt_kept = sent.prompt
    starts = []
    for sample in out.outputs:
        n, full_text = len(sample.token_ids), sample.text
        tokens, text = sent.samples.get(sample.index, (0, ""))
        if n < tokens or not _in_step(sample) or not full_text.startswith(text):
            tokens, text = 0, ""
        if tokens:
            sample.token_ids = sample.token_ids[tokens:]
            if sample.logprobs is not None:
                sample.logprobs = sample.logprobs[tokens:]
            if sample.top_logprobs is not None:
                sample.top_logprobs = sample.top_logprobs[tokens:]
        if text:
            sample.text = full_text[len(text) :]
        starts.append((tokens, len(text)))
        sent.samples[sample.index] = (n, full_text)
    # the prompt's logprobs fill in over a chunked prefill: final once any sample has its first token
    sent.prompt = sent.prompt or any(n for n, _ in sent.samples.values())
    sent.messages += 1
    if prompt_kept:
        out.prompt_token_ids, out.prompt_logprobs, out.prompt_logprob_ranks = [], None, None
    return out, starts, prompt_kept


def _in_step(sample: CompletionOutput) -> bool:
    n = len(sample.token_ids)
    return all(lst is None or len(lst) == n for lst in (sample.logprobs, sample.top_logprobs))


def merge(tail: RequestOutput, starts: Starts, prompt_kept: bool, last: RequestOutput | None) -> RequestOutput:
    """The cumulative output: `last` (the one before, None for the first) continued by `tail`, which is
    completed in place (a fresh decode). Its lists are new: a route may hold an earlier output."""
    before = {} if last is None else {s.index: s for s in last.outputs}
    for sample, (tokens, text) in zip(tail.outputs, starts):
        prev = before.get(sample.index)
        if prev is None:
            continue
        if tokens:
            sample.token_ids = prev.token_ids[:tokens] + sample.token_ids
            if sample.logprobs is not None:
                sample.logprobs = prev.logprobs[:tokens] + sample.logprobs
            if sample.top_logprobs is not None:
                sample.top_logprobs = prev.top_logprobs[:tokens] + sample.top_logprobs
        if text:
            sample.text = prev.text[:text] + sample.text
    if prompt_kept and last is not None:
        tail.prompt_token_ids, tail.prompt_logprobs = last.prompt_token_ids, last.prompt_logprobs
        tail.prompt_logprob_ranks = last.prompt_logprob_ranks
    return tail
