"""Server-sent events of a streamed `/v1/responses` turn, as the openai SDK's `responses.stream()`
accumulates them: created, in_progress, then per output item added -> deltas -> done, then completed
(also for an incomplete turn: the SDK's final-response helper needs `response.completed`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

from rlserve.engine.outputs import RequestOutput
from rlserve.server.openai.responses_output import (
    Turn,
    function_call_item,
    message_item,
    new_id,
    output_text,
    reasoning_item,
)
from rlserve.server.streaming import Run, sse


class _Events:
    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        event = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\n{sse(event)}"


class _Output:
    """The output items so far; only the last one can still be open (receiving deltas)."""

    def __init__(self, events: _Events) -> None:
        self.event = events
        self.items: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open reasoning or message item's text so far
        self.calls: dict[int, dict[str, Any]] = {}  # tool-call delta index -> its item

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def apply(self, delta: dict[str, Any]) -> Iterator[str]:
        if delta.get("reasoning"):
            yield from self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            yield from self._tool_call(call)

    def finish(self, token_fields: dict[str, Any]) -> Iterator[str]:
        if not self.items:  # neither text nor reasoning nor a tool call: one empty message
            yield from self._open(message_item(new_id("msg"), None, "in_progress"))
            yield self._part_added()
        self.open.update(token_fields)  # the last item is still open here
        yield from self._close()

    def _text(self, kind: str, text: str) -> Iterator[str]:
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                yield from self._open(reasoning_item(new_id("rs"), "", "in_progress"))
                yield self.event(
                    "response.reasoning_summary_part.added",
                    item_id=self.open["id"],
                    output_index=self.index,
                    summary_index=0,
                    part={"type": "summary_text", "text": ""},
                )
            else:
                yield from self._open(message_item(new_id("msg"), None, "in_progress"))
                yield self._part_added()
        self.text += text
        where = {"item_id": self.open["id"], "output_index": self.index}
        if kind == "reasoning":
            yield self.event("response.reasoning_summary_text.delta", **where, summary_index=0, delta=text)
        else:
            yield self.event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=[])

    def _part_added(self) -> str:
        return self.event(
            "response.content_part.added",
            item_id=self.open["id"],
            output_index=self.index,
            content_index=0,
            part=output_text(""),
        )

    def _tool_call(self, call: dict[str, Any]) -> Iterator[str]:
        fn = call.get("function") or {}
        if "id" in call:
            item = function_call_item(call["id"], fn.get("name"), "", "in_progress")
            self.calls[call["index"]] = item
            yield from self._open(item)
        item = self.calls[call["index"]]
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            yield self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.items.index(item),
                delta=fn["arguments"],
            )

    def _open(self, item: dict[str, Any]) -> Iterator[str]:
        yield from self._close()
        self.items.append(item)
        self.open, self.text = item, ""
        yield self.event("response.output_item.added", output_index=self.index, item=item)

    def _close(self) -> Iterator[str]:
        item = self.open
        if item is None:
            return
        where = {"item_id": item["id"], "output_index": self.index}
        if item["type"] == "reasoning":
            item["summary"] = [{"type": "summary_text", "text": self.text}]
            yield self.event("response.reasoning_summary_text.done", **where, summary_index=0, text=self.text)
            yield self.event(
                "response.reasoning_summary_part.done",
                **where,
                summary_index=0,
                part={"type": "summary_text", "text": self.text},
            )
        elif item["type"] == "message":
            item["content"] = [output_text(self.text)]
            yield self.event("response.output_text.done", **where, content_index=0, text=self.text, logprobs=[])
            yield self.event("response.content_part.done", **where, content_index=0, part=output_text(self.text))
        else:
            yield self.event(
                "response.function_call_arguments.done", **where, name=item["name"], arguments=item["arguments"]
            )
        item["status"] = "completed"
        self.open = None
        yield self.event("response.output_item.done", output_index=self.index, item=item)


async def stream_events(turn: Turn, run: Run | None) -> AsyncIterator[str]:
    """`run` None: the prompt did not fit, so the turn is one empty message, incomplete."""
    event = _Events()
    output = _Output(event)
    yield event("response.created", response=turn.envelope())
    yield event("response.in_progress", response=turn.envelope())
    final: RequestOutput | None = None
    errors: list = []
    if run is not None:
        streamer = turn.ctx.parser.streamer()
        errors = streamer.tool_call_errors
        async for _, out in run.events():
            final = out
            for chunk in output.apply(streamer.feed(out.outputs[0])):
                yield chunk
    for chunk in output.finish(turn.token_fields(final)):
        yield chunk
    response = turn.finished(output.items, final)
    if errors:  # malformed calls, kept as text (docs/parsers.md)
        response["tool_call_errors"] = [e.to_json() for e in errors]
    yield event("response.completed", response=response)
