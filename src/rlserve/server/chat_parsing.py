"""Where generated chat text becomes `message` fields: reasoning, content and tool calls (§2.10).

With no parser that applies to the request, the engine's text is all content. Otherwise the
parsers read the decode with special tokens kept: the reasoning split first, then the tool parser
on the content part only, so nothing is parsed twice. `streamer()` does the same per request,
incrementally.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from rlserve.engine.detokenizer import IncrementalDetokenizer
from rlserve.engine.outputs import CompletionOutput
from rlserve.engine.params import SamplingParams
from rlserve.server.errors import bad_request
from rlserve.server.parsers import HARMONY, TOOL_PARSER_NAMES, get_tool_parser
from rlserve.server.parsers.base import CallError, CallFormat, Tools
from rlserve.server.parsers.harmony import HarmonyStreamer, kept_stop_ids, parse_harmony
from rlserve.server.parsers.reasoning import (
    END_TAGS,
    ReasoningStreamer,
    count_reasoning_tokens,
    extract_reasoning,
)
from rlserve.server.protocol import ChatCompletionRequest


@dataclass
class ParsedMessage:
    content: str | None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    # Malformed tool calls, kept as content and named here for reward functions (docs/parsers.md).
    tool_call_errors: list[CallError] = field(default_factory=list)


@dataclass
class OutputParser:
    """The parsers one request uses; `raw` when none applies."""

    tokenizer: Any
    params: SamplingParams
    prompt_ids: list[int]
    reasoning_parser: str | None = None
    enable_thinking: bool | None = None
    include_reasoning: bool = True
    tool_parser: CallFormat | None = None
    # gpt-oss: Harmony is read whole (reasoning, content and calls at once); `harmony_tools` None = no calls.
    harmony: bool = False
    harmony_tools: Tools | None = None

    @property
    def raw(self) -> bool:
        return self.reasoning_parser is None and self.tool_parser is None and not self.harmony

    def parse(self, o: CompletionOutput) -> ParsedMessage:
        if self.raw:
            return ParsedMessage(o.text)
        text = SpecialText(self).feed(o)
        if self.harmony:
            h = parse_harmony(text, self.harmony_tools)
            calls = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in h.calls
            ]
            return ParsedMessage(
                h.content or None, (h.reasoning or None) if self.include_reasoning else None, calls, h.errors
            )
        reasoning, content = None, text or None
        if self.reasoning_parser is not None:
            reasoning, content = extract_reasoning(
                text, parser=self.reasoning_parser, enable_thinking=self.enable_thinking
            )
        calls: list[dict[str, Any]] = []
        errors: list[CallError] = []
        if self.tool_parser is not None and content is not None:
            found = self.tool_parser.extract(content)
            errors = found.errors
            content = found.content
            if found.tools_called:
                calls = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in found.tool_calls
                ]
        return ParsedMessage(content, reasoning if self.include_reasoning else None, calls, errors)

    def reasoning_tokens(self, token_ids: list[int]) -> int:
        """usage.completion_tokens_details.reasoning_tokens: up to and including `</think>`."""
        if self.reasoning_parser is None:
            return 0
        end = END_TAGS.get(self.reasoning_parser, "</think>")
        end_id = self.tokenizer.convert_tokens_to_ids(end)
        if not isinstance(end_id, int) or self.tokenizer.convert_ids_to_tokens(end_id) != end:
            end_id = -1  # `</think>` is not one token here (convert_tokens_to_ids gave the unknown token)
        return count_reasoning_tokens(
            token_ids, end_id, parser=self.reasoning_parser, enable_thinking=self.enable_thinking
        )

    def streamer(self) -> MessageStreamer:
        return MessageStreamer(self)


class SpecialText:
    """The completion decoded with special tokens kept, from the cumulative outputs of one choice.
    The token that stopped generation is left out, as the engine leaves it out of `text`, except gpt-oss's
    `<|call|>`, which ends a Harmony call message."""

    def __init__(self, parser: OutputParser):
        params = dataclasses.replace(parser.params, skip_special_tokens=False)
        self._detok = IncrementalDetokenizer.create(parser.tokenizer, parser.prompt_ids, params)
        self._include_stop = params.include_stop_str_in_output
        self._kept_stops = kept_stop_ids(parser.tokenizer) if parser.harmony else frozenset()
        self._fed = self._sent = 0
        self._stopped = False

    def feed(self, o: CompletionOutput) -> str:
        """The text that became certain since the last call (all of it once `o` is finished)."""
        end = len(o.token_ids)
        if (
            end
            and o.finish_reason == "stop"
            and not isinstance(o.stop_reason, str)
            and not (o.stop_reason is not None and self._include_stop)
            and o.token_ids[end - 1] not in self._kept_stops
        ):
            end -= 1  # EOS or a stop token id
        for token in o.token_ids[self._fed : end]:
            if not self._stopped:
                self._stopped = self._detok.feed(token) is not None
        self._fed = max(self._fed, end)
        if o.finished and not self._stopped:
            self._detok.flush()
        text = self._detok.visible_text(o.finished)
        new, self._sent = text[self._sent :], len(text)
        return new


class MessageStreamer:
    """Per-choice streaming counterpart of `OutputParser.parse`: cumulative outputs in, delta fields out."""

    def __init__(self, parser: OutputParser):
        self.has_tool_calls = False  # the last chunk then says finish_reason "tool_calls"
        self.tool_call_errors: list[CallError] = []
        self._include_reasoning = parser.include_reasoning
        self._text = None if parser.raw else SpecialText(parser)
        self._reasoning = (
            None
            if parser.reasoning_parser is None
            else ReasoningStreamer(parser=parser.reasoning_parser, enable_thinking=parser.enable_thinking)
        )
        self._tools = None if parser.tool_parser is None else parser.tool_parser.streamer()
        self._harmony = HarmonyStreamer(parser.harmony_tools) if parser.harmony else None
        self._sent = 0  # raw: characters of `text` sent
        self._done = False

    def feed(self, o: CompletionOutput) -> dict[str, Any]:
        if self._done:
            return {}
        self._done = o.finished
        if self._text is None:
            new, self._sent = o.text[self._sent :], len(o.text)
            return {"content": new} if new else {}
        reasoning, content = "", self._text.feed(o)
        calls: list[dict[str, Any]] = []
        if self._harmony is not None:
            reasoning, content, calls, errors = self._harmony.feed(content, final=o.finished)
            self.tool_call_errors += errors
        elif self._reasoning is not None:
            reasoning, content = self._reasoning.feed(content)
            if o.finished:
                more_reasoning, more_content = self._reasoning.finish()
                reasoning, content = reasoning + more_reasoning, content + more_content
        if self._tools is not None:
            step = self._tools.feed(content)
            content, calls = step.content, step.tool_calls
            self.tool_call_errors += step.errors
            if o.finished:
                last = self._tools.finish()
                content, calls = content + last.content, calls + last.tool_calls
                self.tool_call_errors += last.errors
        self.has_tool_calls = self.has_tool_calls or bool(calls)
        delta: dict[str, Any] = {}
        if reasoning and self._include_reasoning:
            delta["reasoning"] = delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta


def output_parser(
    config_model, tokenizer, body: ChatCompletionRequest, params: SamplingParams, prompt_ids: list[int]
) -> OutputParser:
    """The parsers configured on the server (config.model) that apply to this request."""
    tool_parser_name = config_model.tool_call_parser
    _check_tool_choice(body, tool_parser_name)
    parse_tools = tool_parser_name is not None and bool(body.tools) and body.tool_choice != "none"
    tools = [t.model_dump() for t in body.tools or []]
    if HARMONY in (tool_parser_name, "openai" if config_model.reasoning_parser == "openai_gptoss" else None):
        return OutputParser(
            tokenizer,
            params,
            prompt_ids,
            include_reasoning=body.include_reasoning,
            harmony=True,
            harmony_tools=Tools(tools) if parse_tools else None,
        )
    return OutputParser(
        tokenizer,
        params,
        prompt_ids,
        reasoning_parser=config_model.reasoning_parser,
        enable_thinking=(body.chat_template_kwargs or {}).get("enable_thinking"),
        include_reasoning=body.include_reasoning,
        tool_parser=get_tool_parser(tool_parser_name, tools) if parse_tools else None,
    )


def _check_tool_choice(body: ChatCompletionRequest, tool_parser_name: str | None) -> None:
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return
    named = isinstance(choice, dict)
    if not named and choice != "required":
        raise bad_request(
            f'tool_choice must be "none", "auto", "required" or '
            f'{{"type": "function", "function": {{"name": ...}}}}, got {choice!r}',
            "tool_choice",
        )
    what = "a named tool_choice" if named else 'tool_choice "required"'
    if not body.tools:
        raise bad_request(f'{what} needs tools; send tools or use tool_choice "none" or "auto"', "tool_choice")
    if named:
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        names = [t.function.name for t in body.tools]
        if name not in names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not among the tools {names}", "tool_choice"
            )
    if tool_parser_name is None:
        raise bad_request(
            f"{what} needs a server started with --model.tool_call_parser ({', '.join(TOOL_PARSER_NAMES)})",
            "tool_choice",
        )
