"""Reasoning parsers: split reasoning from content, under vLLM's names (docs/parsers.md).

Most families mark reasoning with a start and an end tag (`<think>…</think>`, `<seed:think>`,
`[THINK]`); the start tag is often in the prompt, so text before the end tag is reasoning. Without
the end tag, a family's tool-call marker ends the reasoning implicitly (the marker starts the
content), else everything is reasoning (or content, where the family says so). granite writes
"Here is my thought process:" / "Here is my response:"; gpt-oss Harmony is read in parsers/harmony.py.
Streaming re-splits the text so far, holding back a suffix that may still grow into a tag.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlserve.server.parsers.base import held_suffix_len


@dataclass(frozen=True)
class ThinkTags:
    start: str = "<think>"
    end: str = "</think>"
    implicit_ends: tuple[str, ...] = ()
    # Without the start tag: False = everything is content (mistral); True = text before `end` is reasoning.
    start_optional: bool = True
    always_content: bool = False  # deepseek_v3 without thinking: an identity parser
    strip_implicit: bool = False  # reasoning ended by a tool-call marker loses its trailing whitespace

    def split(self, text: str, thinking: bool, final: bool = True) -> tuple[str, str]:
        if self.always_content or not thinking:  # qwen3 with thinking off: all content, tags and all (vLLM)
            return "", text
        if not self.start_optional and not text.lstrip().startswith(self.start):
            return "", text.replace(self.end, "", 1)
        s = text.find(self.start)
        end = text.find(self.end)
        if s >= 0 and (end < 0 or s < end):
            # the end tag is looked for after the start tag only: `</thi<think>nk>` holds no end tag
            end = text.find(self.end, s + len(self.start))
            end = end - len(self.start) if end >= 0 else -1
            text = text[:s] + text[s + len(self.start) :]
        implicit = min((i for m in self.implicit_ends if (i := text.find(m)) >= 0), default=-1)
        if implicit >= 0 and (end < 0 or implicit < end):
            # a tool call ends the reasoning; a later end tag is dropped from the content, as vLLM does
            reasoning, content = text[:implicit], text[implicit:].replace(self.end, "", 1)
            return reasoning.rstrip() if self.strip_implicit else reasoning, content
        if end >= 0:
            return text[:end], text[end + len(self.end) :]
        return text, ""

    def markers(self) -> tuple[str, ...]:
        return (self.start, self.end, *self.implicit_ends)


@dataclass(frozen=True)
class GraniteTags:
    THOUGHT = "Here is my thought process:"
    RESPONSE = "Here is my response:"

    def split(self, text: str, thinking: bool, final: bool = True) -> tuple[str, str]:
        t, r = text.find(self.THOUGHT), text.find(self.RESPONSE)
        if not final and r < 0 and (t == 0 or self.THOUGHT.startswith(text)):
            return text[len(self.THOUGHT) :], ""  # vLLM streams an unfinished thought as reasoning
        if t < 0 or r < 0 or r < t:
            return "", text
        return text[t + len(self.THOUGHT) : r], text[r + len(self.RESPONSE) :]

    def markers(self) -> tuple[str, ...]:
        return (self.THOUGHT, self.RESPONSE)


QWEN_TOOL = ("<tool_call>",)
REASONING_PARSERS: dict[str, ThinkTags | GraniteTags | None] = {
    "qwen3": ThinkTags(implicit_ends=QWEN_TOOL),
    "deepseek_r1": ThinkTags(),
    "deepseek_v3": ThinkTags(always_content=True),
    "glm45": ThinkTags(implicit_ends=QWEN_TOOL, strip_implicit=True),
    "kimi_k2": ThinkTags(implicit_ends=("<|tool_calls_section_begin|>",)),
    "minimax_m2": ThinkTags(implicit_ends=("<minimax:tool_call>",), strip_implicit=True),
    "seed_oss": ThinkTags("<seed:think>", "</seed:think>", implicit_ends=("<seed:tool_call>",)),
    "mistral": ThinkTags("[THINK]", "[/THINK]", start_optional=False),
    "granite": GraniteTags(),
    "openai_gptoss": None,  # parsers/harmony.py
}
END_TAGS = {name: tags.end for name, tags in REASONING_PARSERS.items() if isinstance(tags, ThinkTags)}


def check_reasoning_parser(parser: str) -> None:
    if parser not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(REASONING_PARSERS)}")


def _tags(parser: str, enable_thinking: bool | None) -> ThinkTags | GraniteTags:
    check_reasoning_parser(parser)
    tags = REASONING_PARSERS[parser]
    if tags is None:
        raise ValueError("openai_gptoss is read by the Harmony parser")
    if parser == "deepseek_v3" and enable_thinking:
        return REASONING_PARSERS["deepseek_r1"]  # type: ignore[return-value]
    return tags


def _thinking(parser: str, enable_thinking: bool | None) -> bool:
    return parser != "qwen3" or enable_thinking is not False


def extract_reasoning(text: str, *, parser: str, enable_thinking: bool | None = None) -> tuple[str | None, str | None]:
    """(reasoning, content) of a finished output; empty parts become None."""
    reasoning, content = _tags(parser, enable_thinking).split(text, _thinking(parser, enable_thinking))
    return reasoning or None, content or None


class ReasoningStreamer:
    """Per-request streaming split: the concatenated deltas equal `extract_reasoning` of the whole text
    wherever the split only grows (text already sent as reasoning cannot become content)."""

    def __init__(self, *, parser: str, enable_thinking: bool | None = None) -> None:
        self._tags = _tags(parser, enable_thinking)
        self._thinking = _thinking(parser, enable_thinking)
        self._text = ""
        self._sent_reasoning = self._sent_content = 0

    def feed(self, delta_text: str) -> tuple[str, str]:
        self._text += delta_text
        return self._emit(final=False)

    def finish(self) -> tuple[str, str]:
        return self._emit(final=True)

    def _emit(self, final: bool) -> tuple[str, str]:
        decided = (
            self._text if final else self._text[: len(self._text) - held_suffix_len(self._text, self._tags.markers())]
        )
        if not final and getattr(self._tags, "strip_implicit", False):
            decided = decided.rstrip()
        # granite: a thought already streamed as reasoning stays reasoning (vLLM streams it so too).
        reasoning, content = self._tags.split(
            decided, self._thinking, final and not isinstance(self._tags, GraniteTags)
        )
        r, c = reasoning[self._sent_reasoning :], content[self._sent_content :]
        self._sent_reasoning = max(self._sent_reasoning, len(reasoning))
        self._sent_content = max(self._sent_content, len(content))
        return r, c


def count_reasoning_tokens(
    token_ids: Sequence[int], end_token_id: int, *, parser: str, enable_thinking: bool | None = None
) -> int:
    """Generated tokens up to and including the end-of-reasoning tag (usage.reasoning_tokens)."""
    check_reasoning_parser(parser)
    for n, token_id in enumerate(token_ids, 1):
        if token_id == end_token_id:
            return n
    return len(token_ids) if _thinking(parser, enable_thinking) else 0


def reasoning_tags(parser: str | None, enable_thinking: bool | None) -> ThinkTags | None:
    """The start and end tags a request's output reasons between, or None when it does not reason in tags
    (no parser, thinking off, granite's phrases, gpt-oss Harmony, deepseek_v3 without thinking)."""
    if parser is None or not _thinking(parser, enable_thinking):
        return None
    tags = REASONING_PARSERS.get(parser)
    if parser == "deepseek_v3" and enable_thinking:
        tags = REASONING_PARSERS["deepseek_r1"]
    return tags if isinstance(tags, ThinkTags) and not tags.always_content else None
