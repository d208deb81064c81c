"""gpt-oss Harmony output (`openai` tool parser, `openai_gptoss` reasoning parser), read by `openai-harmony`.

The text (decoded with special tokens kept) is re-encoded with the Harmony encoding and fed to its
StreamableParser: the `analysis` channel is reasoning, `final` is content, a `commentary` message to
`functions.NAME` is a call. Streaming re-reads the text so far and sends what is new; a call is sent
when its message ends (`<|call|>`), so it can be checked first.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

from openai_harmony import HarmonyEncodingName, HarmonyError, Role, StreamableParser, load_harmony_encoding

from rlserve.server.parsers.base import (
    UNCLOSED_CALL,
    BadCall,
    CallError,
    ToolCall,
    Tools,
    call_deltas,
    new_call_id,
)

# gpt-oss stops on `<|call|>`, which also closes the call message: the parser must see it, unlike other stop tokens
CALL_END = "<|call|>"


def kept_stop_ids(tokenizer) -> frozenset[int]:
    """The stop token ids whose text the Harmony parser reads: `<|call|>` where it is one token."""
    vocab = tokenizer.get_added_vocab()
    return frozenset([vocab[CALL_END]]) if CALL_END in vocab else frozenset()


@functools.cache
def _encoding():
    return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def check_vocabulary(tool_call_parser: str | None, reasoning_parser: str | None) -> None:
    """Load gpt-oss's vocabulary at server start when a Harmony parser is configured: a vocabulary that
    cannot be read (offline, no file) is then a start error saying what to set, not a 500 on the first chat."""
    if tool_call_parser != "openai" and reasoning_parser != "openai_gptoss":
        return
    try:
        _encoding()
    except HarmonyError as e:
        raise ValueError(
            f"the openai parsers read gpt-oss's Harmony format and openai-harmony could not load its vocabulary "
            f"({e}); offline, set TIKTOKEN_ENCODINGS_BASE to a folder holding o200k_base.tiktoken (docs/parsers.md)"
        ) from None


@dataclass
class HarmonyParse:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    errors: list[CallError] = field(default_factory=list)


def parse_harmony(text: str, tools: Tools | None, final: bool = True) -> HarmonyParse:
    """`tools` None: the request parses no calls (no tools, tool_choice none); call messages stay content."""
    enc = _encoding()
    parser = StreamableParser(enc, role=Role.ASSISTANT)
    try:
        for token in enc.encode(text, allowed_special="all"):
            parser.process(token)
    except Exception as e:  # noqa: BLE001 - a broken message structure: what was read stays, the rest is content
        out = _collect(parser, tools, final=False)
        out.errors.append(CallError("invalid_syntax", f"not valid Harmony: {e}", text))
        return out
    return _collect(parser, tools, final)


def _collect(parser: StreamableParser, tools: Tools | None, final: bool) -> HarmonyParse:
    out = HarmonyParse()
    for msg in parser.messages:
        body = "".join(c.text for c in msg.content if hasattr(c, "text"))
        recipient = msg.recipient or ""
        if recipient.startswith("functions.") and tools is None:
            out.content += body
        elif recipient.startswith("functions."):
            name = recipient.removeprefix("functions.")
            try:
                tools.check(name, body)
                out.calls.append(ToolCall(new_call_id(), name, body))
            except BadCall as e:
                out.errors.append(CallError(e.kind, str(e), body, name))
                out.content += body
        elif msg.channel == "analysis":
            out.reasoning += body
        else:
            out.content += body
    current = parser.current_content or ""
    recipient = parser.current_recipient or ""
    if recipient.startswith("functions.") and tools is not None:
        if final:
            name = recipient.removeprefix("functions.")
            out.errors.append(
                CallError(UNCLOSED_CALL, "the tool call message was not ended with <|call|>", current, name)
            )
            out.content += current
    elif parser.current_channel == "analysis":
        out.reasoning += current
    elif parser.current_channel is not None:
        out.content += current
    return out


class HarmonyStreamer:
    """Reasoning, content and calls as they grow; returns (reasoning, content, tool call deltas, errors)."""

    def __init__(self, tools: Tools | None):
        self.tools = tools
        self.text = ""
        self.sent_reasoning = self.sent_content = self.sent_calls = 0

    def feed(self, delta_text: str, final: bool = False) -> tuple[str, str, list[dict], list[CallError]]:
        self.text += delta_text
        decided = self.text
        if not final:  # a special token may still be arriving: `<|end` is not yet `<|end|>`
            cut = decided.rfind("<")
            if cut >= 0 and ">" not in decided[cut:]:
                decided = decided[:cut]
        now = parse_harmony(decided, self.tools, final)
        reasoning, content = now.reasoning[self.sent_reasoning :], now.content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(now.reasoning), len(now.content)
        deltas = call_deltas(self.sent_calls, now.calls[self.sent_calls :])
        self.sent_calls = len(now.calls)
        errors = now.errors if final else []  # text cut mid-stream is not yet an error
        return reasoning, content, deltas, errors
