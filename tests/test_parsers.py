"""Reasoning and tool-call parsers (server/parsers/, docs/parsers.md): non-streaming results, and streaming
that adds up to the same thing however the text is cut into deltas. Hand-written edge cases beside the
recorded vLLM corpus of tests/test_parser_corpus.py; where vLLM 0.32 drops a malformed call, rlserve keeps
its raw text as content and names it in `errors` (the RL flag)."""

import json
import random
import re

import pytest

from rlserve.server.parsers import TOOL_PARSER_NAMES, get_tool_parser
from rlserve.server.parsers.reasoning import ReasoningStreamer, count_reasoning_tokens, extract_reasoning

OPENAI_ID = re.compile(r"chatcmpl-tool-[0-9a-f]{32}")
MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def splits(text: str):
    """The whole text, every cut into two pieces, char by char, and a few random cuts."""
    yield [text]
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(text)
    for _ in range(5):
        cuts = sorted(rng.randint(0, len(text)) for _ in range(rng.randint(1, 8)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


def stream_tools(parser, pieces):
    """Feed `pieces`, check the OpenAI chunk-delta shape, return (content, calls)."""
    streamer = parser.streamer()
    deltas = [streamer.feed(p) for p in pieces] + [streamer.finish()]
    calls: dict[int, dict] = {}
    for delta in deltas:
        for tc in delta.tool_calls:
            i = tc["index"]
            if i not in calls:
                assert tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:  # later deltas carry argument text only: one id and one name per call
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
                calls[i]["arguments"] += tc["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    assert len({c["id"] for c in calls.values()}) == len(calls)
    return "".join(d.content or "" for d in deltas), [calls[i] for i in range(len(calls))]


def assert_streaming_matches(parser_name: str, text: str, id_pattern=OPENAI_ID) -> None:
    parser = get_tool_parser(parser_name)
    expected = parser.extract(text)
    want = [(c.name, c.arguments) for c in expected.tool_calls]
    for pieces in splits(text):
        content, calls = stream_tools(parser, pieces)
        assert content == (expected.content or ""), pieces
        assert [(c["name"], c["arguments"]) for c in calls] == want, pieces
        assert all(id_pattern.fullmatch(c["id"]) for c in calls)


def names_and_args(result):
    return [(c.name, c.arguments) for c in result.tool_calls]


# ---------------------------------------------------------------- hermes

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "SF", "days": 2}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Zürich"}}\n</tool_call>'
BAD = '<tool_call>\n{"name": "broken", "arguments": {"x": }\n</tool_call>'

HERMES_TEXTS = [
    "",
    "Just an answer, no tools.",
    WEATHER,
    "Let me check.\n" + WEATHER,
    "\n\n" + WEATHER + "\n" + TIME,
    "pre " + WEATHER + " between " + TIME + " after",
    WEATHER + BAD,
    BAD + WEATHER,
    'I will call <tool_call>{"name": "f"}</tool_call>',
    "ok " + '<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n',
    'truncated <tool_call>\n{"name": "f", "argu',
    '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
    '<tool_call>{"name": "tr", "arguments": {"text": "héllo 世界 🌍", "esc": "\\u4e16"}}</tool_call>',
    "a < b, <tool and <tool_cal> are not tags",
    "ends with a partial tag <tool_ca",
    "<tool_call></tool_call>",
    '<tool_call>{"name": "f", "arguments": {}}</tool_call><tool_call>{"name": "g", "arguments": null}',
]


def test_hermes_several_calls_with_content_before():
    result = get_tool_parser("hermes").extract("Let me check.\n" + WEATHER + "\n" + TIME)
    assert result.tools_called
    assert names_and_args(result) == [
        ("get_weather", '{"city": "SF", "days": 2}'),
        ("get_time", '{"tz": "Europe/Zürich"}'),
    ]
    assert result.content == "Let me check.\n"
    assert all(OPENAI_ID.fullmatch(c.id) for c in result.tool_calls)
    assert len({c.id for c in result.tool_calls}) == 2


def test_hermes_text_between_and_after_calls_is_dropped():
    result = get_tool_parser("hermes").extract(WEATHER + " between " + TIME + " after")
    assert [c.name for c in result.tool_calls] == ["get_weather", "get_time"]
    assert result.content is None


@pytest.mark.parametrize(
    "text,kind",
    [
        (BAD, "invalid_json"),
        ('<tool_call>["f", {}]</tool_call>', "invalid_syntax"),
        ("<tool_call></tool_call>", "invalid_json"),
    ],
)
def test_hermes_bad_call_stays_as_content_and_is_flagged(text, kind):
    result = get_tool_parser("hermes").extract(text)
    assert not result.tools_called and result.tool_calls == []
    assert result.content == text
    assert [(e.kind, e.text) for e in result.errors] == [(kind, text)]


@pytest.mark.parametrize("text", [WEATHER + BAD, BAD + WEATHER])
def test_hermes_bad_call_beside_a_good_one_keeps_the_good_one(text):
    result = get_tool_parser("hermes").extract(text)
    assert names_and_args(result) == [("get_weather", '{"city": "SF", "days": 2}')]
    assert result.content == BAD and [e.kind for e in result.errors] == ["invalid_json"]


def test_hermes_missing_arguments_become_empty_object():
    result = get_tool_parser("hermes").extract('<tool_call>{"name": "f"}</tool_call>')
    assert names_and_args(result) == [("f", "{}")]


def test_hermes_unclosed_final_call_is_flagged_and_kept_as_content():
    cut = '\n<tool_call>\n{"name": "f", "arguments": {"a": [1, 2]}}\n'
    result = get_tool_parser("hermes").extract(WEATHER + cut)
    assert names_and_args(result) == [("get_weather", '{"city": "SF", "days": 2}')]
    assert [e.kind for e in result.errors] == ["unclosed_call"]
    assert result.content == cut.lstrip("\n")


def test_unknown_tool_and_schema_mismatch_are_flagged_when_tools_are_sent():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"days": {"type": "integer"}}},
            },
        }
    ]
    parser = get_tool_parser("hermes", tools)
    unknown = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    mismatch = '<tool_call>{"name": "get_weather", "arguments": {"days": "two"}}</tool_call>'
    for text, kind in ((unknown, "unknown_tool"), (mismatch, "schema_mismatch")):
        result = parser.extract(text)
        assert result.tool_calls == [] and result.content == text and [e.kind for e in result.errors] == [kind]


def test_hermes_arguments_object_or_already_serialised_string():
    parser = get_tool_parser("hermes")
    as_object = parser.extract('<tool_call>{"name": "f", "arguments": {"a":1,"b":[true,null]}}</tool_call>')
    as_string = parser.extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert as_object.tool_calls[0].arguments == '{"a": 1, "b": [true, null]}'
    assert as_string.tool_calls[0].arguments == '{"a": 1}'


def test_hermes_keeps_non_ascii_arguments():
    result = get_tool_parser("hermes").extract(HERMES_TEXTS[12])
    arguments = result.tool_calls[0].arguments
    assert arguments == '{"text": "héllo 世界 🌍", "esc": "世"}'
    assert json.loads(arguments)["text"] == "héllo 世界 🌍"


def test_hermes_streaming_holds_back_partial_tag_and_never_leaks_markup():
    streamer = get_tool_parser("hermes").streamer()
    assert streamer.feed("Hi <tool").content == "Hi "
    assert streamer.feed("bar").content == "<toolbar"
    assert streamer.feed(" <tool_call>").content == " "
    assert streamer.feed('{"name": "f", "arguments": {}}').content == ""
    closed = streamer.feed("</tool_call>")
    assert closed.content == ""
    assert closed.tool_calls[0]["function"] == {"name": "f", "arguments": ""}
    assert closed.tool_calls[1] == {"index": 0, "function": {"arguments": "{}"}}
    assert streamer.finish().content == ""


@pytest.mark.parametrize("text", HERMES_TEXTS)
def test_hermes_streaming_matches_non_streaming(text):
    assert_streaming_matches("hermes", text)


# ---------------------------------------------------------------- llama3_json

LLAMA_TEXTS = [
    "",
    "Plain answer.",
    '<|python_tag|>{"name": "f", "parameters": {"x": 1}}',
    '{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {"y": "ü"}}',
    '{"name":"f","arguments":{"x":1}};{"name":"g","arguments":{}}',
    '{"name": "f", "arguments": {"q": {"deep": [1, {"x": 2}]}}}',
    '{"name": "f"}',
    '{"name": "f", "arguments": {"x": 1}}; {"name": ',
    "{not json}",
    "<|python_tag|>",
    "<|python",
    '{"name": "f", "arguments": "{\\"x\\": 1}"}',
]


def test_llama3_json_python_tag_semicolons_and_parameters():
    parser = get_tool_parser("llama3_json")
    result = parser.extract(
        '<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "arguments": {"y": "ü"}}'
    )
    assert names_and_args(result) == [("f", '{"x": 1}'), ("g", '{"y": "ü"}')]
    assert result.content is None
    assert all(OPENAI_ID.fullmatch(c.id) for c in result.tool_calls)


def test_llama3_json_finds_objects_inside_prose_and_drops_the_prose():
    result = get_tool_parser("llama4_json").extract('Calling: {"name": "f", "arguments": {}} now')
    assert names_and_args(result) == [("f", "{}")]
    assert result.content is None


@pytest.mark.parametrize(
    "text",
    [
        '{"name": "f", "arguments": {}}; {bad}',
        '{"arguments": {}}',
        "use {x} here",
        '{"name": "f", "arguments": {}',
    ],
)
def test_llama3_json_all_or_nothing(text):
    result = get_tool_parser("llama3_json").extract(text)
    assert not result.tools_called and result.content == text and result.errors


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_llama3_json_streaming_matches_non_streaming(text):
    assert_streaming_matches("llama3_json", text)


# ---------------------------------------------------------------- mistral

PRE_V11 = '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "ß"}}]'
V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "SF"}[TOOL_CALLS]get_time{"tz":"UTC"}'

MISTRAL_TEXTS = [
    "",
    "Hello there.",
    "partial marker [TOOL_CA",
    PRE_V11,
    "Sure. " + PRE_V11 + "</s>",
    '[TOOL_CALLS][{"name": "f"}]',
    '[TOOL_CALLS] {"name": "f", "arguments": {}}',
    '[TOOL_CALLS] [{"name": "f", "arguments": {]',
    '[TOOL_CALLS] [{"name": "f", "arguments": {}}][TOOL_CALLS] [{"name": "g", "arguments": {}}]',
    "[TOOL_CALLS] []",
    V11,
    "Checking. " + V11,
    '[TOOL_CALLS]oops[TOOL_CALLS]f{"a": 1}',
    '[TOOL_CALLS]f{"a": 1,, "[TOOL"}',
    "[TOOL_CALLS]",
    "text [TOOL_CALLS]name_without_args",
]


def test_mistral_pre_v11_list_after_marker():
    result = get_tool_parser("mistral").extract("Sure. " + PRE_V11)
    assert names_and_args(result) == [("f", '{"a": 1}'), ("g", '{"b": "ß"}')]
    assert result.content == "Sure. "
    assert all(MISTRAL_ID.fullmatch(c.id) for c in result.tool_calls)


def test_mistral_pre_v11_missing_arguments_become_empty_object():
    result = get_tool_parser("mistral").extract('[TOOL_CALLS][{"name": "f"}]')
    assert names_and_args(result) == [("f", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        '[TOOL_CALLS] [{"name": "f", "arguments": {]',
        '[TOOL_CALLS] [{"name": "f", "arguments": {}}] [TOOL_CALLS] [{"name": "g", "arguments": {}}]',
    ],
)
def test_mistral_pre_v11_failure_keeps_the_whole_text_and_flags_it(text):
    result = get_tool_parser("mistral").extract("before " + text)
    assert not result.tools_called
    assert result.content == "before " + text and [e.kind for e in result.errors] == ["invalid_json"]
    for pieces in splits("before " + text):
        assert stream_tools(get_tool_parser("mistral"), pieces) == ("before " + text, [])


def test_mistral_v11_keeps_arguments_verbatim():
    parser = get_tool_parser("mistral")
    result = parser.extract("Checking. " + V11)
    assert names_and_args(result) == [
        ("get_weather", '{"city": "SF"}'),
        ("get_time", '{"tz":"UTC"}'),
    ]
    assert result.content == "Checking. "
    bad = '[TOOL_CALLS]oops[TOOL_CALLS]f{"a": 1,,}'
    result = parser.extract(bad)  # vLLM 0.32 returns a call named "oops[TOOL_CALLS]f" with broken JSON
    assert result.tool_calls == [] and result.content == bad
    assert [e.kind for e in result.errors] == ["invalid_syntax", "invalid_json"]


def test_mistral_v11_streams_each_call_when_the_next_marker_or_the_end_closes_it():
    streamer = get_tool_parser("mistral").streamer()
    assert streamer.feed("Hi [TOOL_CALLS]get_wea").tool_calls == []
    assert streamer.feed('ther[ARGS]{"ci').tool_calls == []
    assert streamer.feed('ty": "SF"}[TOOL_').tool_calls == []
    first = streamer.feed("CALLS]g{}").tool_calls
    assert first[0]["function"] == {"name": "get_weather", "arguments": ""} and MISTRAL_ID.fullmatch(first[0]["id"])
    assert first[1] == {"index": 0, "function": {"arguments": '{"city": "SF"}'}}
    last = streamer.finish().tool_calls
    assert last[0]["index"] == 1 and last[0]["function"] == {"name": "g", "arguments": ""}


@pytest.mark.parametrize("text", MISTRAL_TEXTS)
def test_mistral_streaming_matches_non_streaming(text):
    assert_streaming_matches("mistral", text, id_pattern=MISTRAL_ID)


def test_unknown_tool_parser_names_the_known_ones():
    with pytest.raises(ValueError, match=", ".join(TOOL_PARSER_NAMES)):
        get_tool_parser("hermes2")


# ---------------------------------------------------------------- reasoning

QWEN35_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nSF\n</parameter>\n</function>\n</tool_call>"

REASONING_CASES = [
    # text, parser, enable_thinking, (reasoning, content)
    ("<think>\nplan\n</think>\n\nAnswer", "qwen3", None, ("\nplan\n", "\n\nAnswer")),
    ("plan</think>Answer", "qwen3", True, ("plan", "Answer")),
    ("plan</think>Answer", "deepseek_r1", None, ("plan", "Answer")),
    ("<think>plan</think>", "deepseek_r1", None, ("plan", None)),
    ("<think></think>Answer", "qwen3", None, (None, "Answer")),
    ("unfinished thought", "deepseek_r1", None, ("unfinished thought", None)),
    ("<think>unfinished thought", "deepseek_r1", False, ("unfinished thought", None)),
    ("unfinished thought", "qwen3", None, ("unfinished thought", None)),
    ("plain answer", "qwen3", False, (None, "plain answer")),
    ("<think>plain answer", "qwen3", False, (None, "<think>plain answer")),
    ("hm</think>answer", "qwen3", False, (None, "hm</think>answer")),
    ("a</think>b<think>c", "qwen3", None, ("a", "b<think>c")),
    ("<think>a<think>b</think>c", "deepseek_r1", None, ("a<think>b", "c")),
    ("I'll call it. " + QWEN35_CALL, "qwen3", None, ("I'll call it. ", QWEN35_CALL)),
    (QWEN35_CALL, "qwen3", None, (None, QWEN35_CALL)),
    ("I'll call it. " + QWEN35_CALL, "deepseek_r1", None, ("I'll call it. " + QWEN35_CALL, None)),
    # vLLM 0.32: the first <tool_call> ends qwen3's reasoning, a later </think> is dropped
    ("x " + QWEN35_CALL + "</think>y", "qwen3", None, ("x ", QWEN35_CALL + "y")),
    ("a <tool_call> mention b", "qwen3", None, ("a ", "<tool_call> mention b")),
    ("a <tool_call> mention " + QWEN35_CALL, "qwen3", None, ("a ", "<tool_call> mention " + QWEN35_CALL)),
    ("ends <tool_call>\n<function", "qwen3", None, ("ends ", "<tool_call>\n<function")),
    ("</thi<think>nk>", "qwen3", None, ("</think>", None)),
    ("partial end </thi", "deepseek_r1", None, ("partial end </thi", None)),
    ("思考</think>答案", "qwen3", None, ("思考", "答案")),
    ("", "qwen3", None, (None, None)),
    ("</think>", "deepseek_r1", None, (None, None)),
]


@pytest.mark.parametrize("text,parser,enable_thinking,expected", REASONING_CASES)
def test_extract_reasoning(text, parser, enable_thinking, expected):
    assert extract_reasoning(text, parser=parser, enable_thinking=enable_thinking) == expected


def stream_reasoning(pieces, **kwargs):
    streamer = ReasoningStreamer(**kwargs)
    outs = [streamer.feed(p) for p in pieces] + [streamer.finish()]
    return "".join(r for r, _ in outs), "".join(c for _, c in outs)


STREAMABLE_REASONING_CASES = REASONING_CASES


@pytest.mark.parametrize("text,parser,enable_thinking,expected", STREAMABLE_REASONING_CASES)
def test_reasoning_streaming_matches_non_streaming(text, parser, enable_thinking, expected):
    want = tuple(part or "" for part in expected)
    for pieces in splits(text):
        assert stream_reasoning(pieces, parser=parser, enable_thinking=enable_thinking) == want, pieces


def test_reasoning_streaming_with_thinking_off_sends_everything_as_content():
    for pieces in splits("<think>hm</think>answer"):
        assert stream_reasoning(pieces, parser="qwen3", enable_thinking=False) == ("", "<think>hm</think>answer")


def test_reasoning_streaming_tag_tokens_produce_no_text():
    streamer = ReasoningStreamer(parser="qwen3")
    assert [streamer.feed(t) for t in ["<think>", "a", "</think>", "b"]] == [
        ("", ""),
        ("a", ""),
        ("", ""),
        ("", "b"),
    ]
    assert streamer.finish() == ("", "")


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="qwen3, deepseek_r1, .*openai_gptoss"):
        extract_reasoning("x", parser="gpt_oss")


@pytest.mark.parametrize(
    "ids,parser,enable_thinking,expected",
    [
        ([5, 6, 99, 7], "qwen3", None, 3),
        ([99, 7], "deepseek_r1", None, 1),
        ([5, 6, 7], "qwen3", None, 3),
        ([5, 6, 7], "qwen3", False, 0),
        ([5, 99, 7, 99], "qwen3", False, 2),
        ([5, 6, 7], "deepseek_r1", None, 3),
        ([], "qwen3", None, 0),
    ],
)
def test_count_reasoning_tokens(ids, parser, enable_thinking, expected):
    assert count_reasoning_tokens(ids, 99, parser=parser, enable_thinking=enable_thinking) == expected


def test_reasoning_then_hermes_stream_like_the_server():
    text = "<think>\nNeed the weather.\n</think>\n\n" + WEATHER
    reasoning, content = extract_reasoning(text, parser="qwen3")
    expected = get_tool_parser("hermes").extract(content)
    for pieces in splits(text):
        splitter, tools = ReasoningStreamer(parser="qwen3"), get_tool_parser("hermes").streamer()
        thought, said, calls = "", "", []
        for r, c in [splitter.feed(p) for p in pieces] + [splitter.finish()]:
            thought += r
            delta = tools.feed(c)
            said, calls = said + delta.content, calls + delta.tool_calls
        final = tools.finish()
        said, calls = said + final.content, calls + final.tool_calls
        assert thought == reasoning and said == (expected.content or "")
        assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
        assert "".join(c["function"]["arguments"] for c in calls) == expected.tool_calls[0].arguments
