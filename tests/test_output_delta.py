"""The engine boundary's deltas (runtime/output_delta.py): each step's message carries only what the
server lacks, and the server rebuilds exactly the engine's cumulative outputs from them, through
the real msgpack wire, whatever a request does (a chunked prefill filling in its prompt logprobs,
samples forked after the prompt, a text that is not an extension, the finish)."""

from __future__ import annotations

from rlserve.engine.outputs import CompletionOutput, RequestOutput, VersionSpan
from rlserve.runtime import ipc
from rlserve.runtime.output_delta import Sent, merge, trim

PROMPT = list(range(1000, 1000 + 4096))


def sample(index: int, n: int, text: str | None = None, finish: str | None = None) -> CompletionOutput:
    ids = [7 * index + i for i in range(n)]
    return CompletionOutput(
        index=index, token_ids=ids, text="".join(f"<{t}>" for t in ids) if text is None else text,
        logprobs=[-0.5 - t / 100 for t in ids], top_logprobs=[{t: -0.5, t + 1: -2.0} for t in ids],
        finish_reason=finish, version_spans=[VersionSpan(3, 0, n)] if n else [],
    )  # fmt: skip


def request(samples: list[CompletionOutput], filled: int, finished: bool = False) -> RequestOutput:
    """A prompt whose logprobs are known for the first `filled` positions (a chunked prefill's progress)."""
    plp = [None] + [{t: -1.0} if i < filled else None for i, t in enumerate(PROMPT[1:], start=1)]
    return RequestOutput(request_id="r", prompt_token_ids=list(PROMPT), outputs=samples, prompt_logprobs=plp,
                         num_cached_tokens=16, finished=finished)  # fmt: skip


def life() -> list[RequestOutput]:
    """One n=2 request's cumulative outputs, step by step, as the engine hands them back."""
    steps = [request([sample(0, 0)], 2048), request([sample(0, 0)], 4096)]  # two prefill chunks
    steps += [request([sample(0, 1)], 4096)]  # first token; the sibling is forked after it
    steps += [request([sample(0, k), sample(1, k - 1)], 4096) for k in range(2, 40)]
    steps.append(request([sample(0, 40, text="rewritten"), sample(1, 39)], 4096))  # not an extension
    steps.append(request([sample(0, 41, finish="length"), sample(1, 40, finish="stop")], 4096, finished=True))
    return steps


def across_the_wire(outputs: list[RequestOutput]) -> tuple[list[RequestOutput], list[int]]:
    sent, last, got, sizes = Sent(), None, [], []
    for out in outputs:
        wire = ipc.encode(ipc.Outputs([ipc.Delta(5, *trim(out, sent))], ipc.State(0, "v", {}, False, {})))
        sizes.append(len(wire))
        (delta,) = ipc.to_server.decode(wire).items
        last = merge(delta.output, delta.starts, delta.prompt_kept, last)
        got.append(last)
    return got, sizes


def test_the_server_rebuilds_every_cumulative_output_exactly():
    got, _ = across_the_wire(life())  # trim cuts down fresh outputs in place, as Request.output() makes them
    assert got == life()


def test_a_step_carries_the_new_token_not_the_prompt_or_the_tokens_before_it():
    _, sizes = across_the_wire(life())
    prefill, decode = sizes[:3], sizes[3:-2]
    assert min(prefill) > 4 * len(PROMPT)  # the prompt's ids and logprobs go while the prefill fills them in
    assert max(decode) < 1000  # then a step is its new tokens (and field names): the same at token 2 and 39
    assert max(decode) - min(decode) < 40


def test_merge_gives_new_lists_so_an_earlier_output_a_route_holds_is_unchanged():
    got, _ = across_the_wire(life()[:6])
    held = got[3]
    assert len(held.outputs[0].token_ids) == 2 and held.outputs[0].token_ids is not got[4].outputs[0].token_ids
    assert held == life()[3]


def test_a_resend_from_offset_zero_replaces_what_the_server_had():
    sent = Sent()
    trim(request([sample(0, 5)], 4096), sent)
    tail, starts, kept = trim(request([sample(0, 6, text="other")], 4096), sent)
    assert starts == [(0, 0)] and kept and tail.outputs[0].text == "other" and len(tail.outputs[0].token_ids) == 6
