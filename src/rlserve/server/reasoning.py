"""Split `<think>…</think>` reasoning from content (wire-protocols §2.10).

Variants:
- `deepseek_r1`: no `</think>` means the thought never finished: everything is reasoning.
- `qwen3`: no `</think>` means everything is content when `enable_thinking` is False, otherwise
  everything is reasoning, except that `<tool_call>` followed by `<function` (Qwen3.5) ends the
  reasoning implicitly; the tool call then starts the content.

The first `<think>` before the end of reasoning is removed (many templates put it in the prompt).
"""

from __future__ import annotations

from collections.abc import Sequence

START, END, TOOL_CALL, FUNCTION = "<think>", "</think>", "<tool_call>", "<function"
PARSERS = ("deepseek_r1", "qwen3")


def _check_parser(parser: str) -> None:
    if parser not in PARSERS:
        raise ValueError(f"unknown reasoning parser {parser!r}; known: {', '.join(PARSERS)}")


def _thinking(parser: str, enable_thinking: bool | None) -> bool:
    return parser == "deepseek_r1" or enable_thinking is not False


def _opens_function(after: str) -> bool | None:
    """Whether `<tool_call>` followed by `after` opens a Qwen3.5 call; None while undecidable."""
    s = after.lstrip()
    if len(s) > len(FUNCTION) and s.startswith(FUNCTION):
        return s[len(FUNCTION)] == "=" or s[len(FUNCTION)].isspace()
    return None if FUNCTION.startswith(s) else False


def _implicit_end(text: str) -> int:
    """Index of the first `<tool_call>` that opens a Qwen3.5 call, or -1."""
    i = text.find(TOOL_CALL)
    while i >= 0:
        if _opens_function(text[i + len(TOOL_CALL) :]):
            return i
        i = text.find(TOOL_CALL, i + 1)
    return -1


def _held_tag_len(text: str, tags: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that could still grow into one of `tags`."""
    i = text.find("<", max(0, len(text) - max(map(len, tags)) + 1))  # every tag starts with "<"
    while i >= 0:
        if any(tag.startswith(text[i:]) for tag in tags):
            return len(text) - i
        i = text.find("<", i + 1)
    return 0


def extract_reasoning(text: str, *, parser: str, enable_thinking: bool | None = None) -> tuple[str | None, str | None]:
    """Return (reasoning, content) of a finished output; empty parts become None."""
    _check_parser(parser)
    thinking = _thinking(parser, enable_thinking)
    end = text.find(END)
    after = end + len(END)
    if end < 0 and parser == "qwen3" and thinking:
        end = after = _implicit_end(text)  # the tool call stays in the content
    start = text.find(START)
    if start >= 0 and (end < 0 or start < end):
        text = text[:start] + text[start + len(START) :]
        end, after = end - len(START), after - len(START)
    if end < 0:
        reasoning, content = (text, None) if thinking else (None, text)
    else:
        reasoning, content = text[:end], text[after:]
    return reasoning or None, content or None


_REASONING, _PENDING_TOOL_CALL, _CONTENT_BEFORE_END, _CONTENT = range(4)


class ReasoningStreamer:
    """Per-request streaming split; never emits tag text.

    The concatenated deltas equal `extract_reasoning` of the whole text, with one exception:
    qwen3 with `enable_thinking=False` streams everything as content, because text already sent
    as content cannot become reasoning when a late `</think>` shows up (the tag is dropped).
    """

    def __init__(self, *, parser: str, enable_thinking: bool | None = None) -> None:
        _check_parser(parser)
        thinking = _thinking(parser, enable_thinking)
        self._tool_call_ends = parser == "qwen3" and thinking
        self._state = _REASONING if thinking else _CONTENT_BEFORE_END
        self._start_seen = False
        self._buf = ""

    def feed(self, delta_text: str) -> tuple[str, str]:
        """Return (reasoning_delta, content_delta) for one more piece of decoded text."""
        self._buf += delta_text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        """Flush the held-back text at the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if self._state == _CONTENT:
                content.append(self._buf)
                self._buf = ""
            elif self._state == _PENDING_TOOL_CALL:
                if not self._resolve_pending(reasoning, content, final):
                    break
            elif not self._step(reasoning if self._state == _REASONING else content, final):
                break
        return "".join(reasoning), "".join(content)

    def _step(self, sink: list[str], final: bool) -> bool:
        """Consume text up to and including the next tag; False when waiting for more text."""
        tags = [END]
        if not self._start_seen:
            tags.append(START)
        if self._tool_call_ends and self._state == _REASONING:
            tags.append(TOOL_CALL)
        found = [(i, tag) for tag in tags if (i := self._buf.find(tag)) >= 0]
        if not found:
            keep = 0 if final else _held_tag_len(self._buf, tags)
            sink.append(self._buf[: len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        i, tag = min(found)
        sink.append(self._buf[:i])
        if tag == TOOL_CALL:
            opens = _opens_function(self._buf[i + len(tag) :])
            if opens is None and not final:
                self._buf = self._buf[i:]
                return False
            if opens:
                self._buf = self._buf[i:]
                self._state = _PENDING_TOOL_CALL
                return True
            sink.append(tag)
        elif tag == START:
            self._start_seen = True
        else:
            self._state = _CONTENT
        self._buf = self._buf[i + len(tag) :]
        return True

    def _resolve_pending(self, reasoning: list[str], content: list[str], final: bool) -> bool:
        # A later `</think>` wins over the implicit end, so the call may still be reasoning.
        j = self._buf.find(END)
        if j >= 0:
            held = self._buf[:j]
            if not self._start_seen and START in held:
                held = held.replace(START, "", 1)
            reasoning.append(held)
            self._buf = self._buf[j + len(END) :]
            self._state = _CONTENT
            return True
        if final:
            content.append(self._buf)
            self._buf = ""
        return False


def count_reasoning_tokens(
    token_ids: Sequence[int], end_token_id: int, *, parser: str, enable_thinking: bool | None = None
) -> int:
    """Generated tokens up to and including the first `</think>` (usage.reasoning_tokens).

    Without `</think>` it counts every token when the text is all reasoning, else 0; the
    Qwen3.5 implicit end is not seen at the id level, so such a call counts as reasoning.
    """
    _check_parser(parser)
    for n, token_id in enumerate(token_ids, 1):
        if token_id == end_token_id:
            return n
    return len(token_ids) if _thinking(parser, enable_thinking) else 0
