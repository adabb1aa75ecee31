"""Tool-call parsing (runtime/server/tool_parsers.py): each format's calls and content, exactly; streaming
joined equal to the whole reply's parse at every split; the deltas in OpenAI's streaming shape."""

from __future__ import annotations

import json
import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from optc.runtime.server.tool_parsers import Parser, ToolCallStream, parse_tool_calls

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
TIME = '{"name": "get_time", "arguments": {}}'

# (parser, reply, content, [(name, arguments)])
CASES = [
    (Parser.HERMES, f"<tool_call>\n{WEATHER}\n</tool_call>", None,
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (Parser.HERMES, f"Let me look.\n\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}\n</tool_call>\n",
     "Let me look.", [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    (Parser.HERMES, f"<think>\nweather\n</think>\n\n<tool_call>\n{TIME}\n</tool_call>\n Done. ",
     "<think>\nweather\n</think>Done. ", [("get_time", "{}")]),
    (Parser.HERMES, "  It is sunny in Paris.\n", "  It is sunny in Paris.\n", []),
    (Parser.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),
    (Parser.HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call> x <tool_call>{"name": "g", "arguments": '
     '{"v": NaN}}</tool_call>', '<tool_call>{"name": "f", "arguments": [1]}</tool_call> x <tool_call>{"name": "g", '
     '"arguments": {"v": NaN}}</tool_call>', []),  # arguments not an object; NaN is not JSON
    (Parser.HERMES, f"<tool_call>\n{TIME}", None, [("get_time", "{}")]),  # unclosed at the end: EOS came first
    (Parser.HERMES, '<tool_call>\n{"name": "get_weather", "arguments": {"ci', '<tool_call>\n{"name": "get_weather", '
     '"arguments": {"ci', []),  # cut off by max_tokens
    (Parser.HERMES, "a <tool_cal", "a <tool_cal", []),
    # the tag inside a JSON string: SmolLM2 wrote one in a forced call's argument (tests/test_structured_smollm2.py)
    (Parser.HERMES, '<tool_call>\n{"name": "w", "arguments": {"q": "</tool_call> é"}}\n</tool_call>', None,
     [("w", '{"q": "</tool_call> é"}')]),
    (Parser.HERMES, '<tool_call>{"name": "w", "arguments": {"q": 1}</tool_call> x </tool_call>',  # broken: 1st ends
     '<tool_call>{"name": "w", "arguments": {"q": 1}</tool_call> x </tool_call>', []),
    (Parser.HERMES, '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>',
     '<tool_call>{"name": "f", "arguments": {"x": 1e999}}</tool_call>', []),  # infinity has no JSON text
    (Parser.LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', None,
     [("get_weather", '{"city": "Paris", "days": 3}')]),
    (Parser.LLAMA3_JSON, '<|python_tag|>{"name": "a", "parameters": {"é": "ü"}}; {"name": "b", "arguments": {}}',
     None, [("a", '{"é": "ü"}'), ("b", "{}")]),
    (Parser.LLAMA3_JSON, ' {"name": "a", "parameters": {}};', ' {"name": "a", "parameters": {}};', []),
    (Parser.LLAMA3_JSON, '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}',
     '{"name": "a", "parameters": {}} {"name": "b", "parameters": {}}', []),
    (Parser.LLAMA3_JSON, '{"title": "JSON the user asked for"}', '{"title": "JSON the user asked for"}', []),
    (Parser.LLAMA3_JSON, "Paris is sunny.", "Paris is sunny.", []),
    (Parser.LLAMA3_JSON, "<|python_tag|>brave_search.call(query=\"x\")", "<|python_tag|>brave_search.call(query=\"x\")",
     []),
    (Parser.MISTRAL, f"[TOOL_CALLS][{WEATHER}, {TIME}]", None,
     [("get_weather", '{"city": "Paris", "days": 3}'), ("get_time", "{}")]),
    (Parser.MISTRAL, f"I'll check. [TOOL_CALLS] [{TIME}] \n", "I'll check.", [("get_time", "{}")]),
    (Parser.MISTRAL, f"[TOOL_CALLS][{TIME}] and more", f"[TOOL_CALLS][{TIME}] and more", []),
    (Parser.MISTRAL, "[TOOL_CALLS][]", "[TOOL_CALLS][]", []),
    (Parser.MISTRAL, "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": 1}]",
     "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": {}, \"id\": 1}]", []),  # a key a call does not have
    (Parser.MISTRAL, "No calls [TOOL_CA", "No calls [TOOL_CA", []),
    (Parser.HERMES, "", "", []),
]


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), CASES)
def test_parse(parser, reply, content, calls):
    got_content, got_calls = parse_tool_calls(reply, parser, random.Random(0))
    assert got_content == content
    assert [(c.name, c.arguments) for c in got_calls] == calls
    for call in got_calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize(("parser", "reply", "content", "calls"), CASES)
def test_stream_at_every_split_equals_parse(parser, reply, content, calls):
    expected = parse_tool_calls(reply, parser, random.Random(0))
    for cut in range(len(reply) + 1):
        assert _streamed(parser, [reply[:cut], reply[cut:]]) == expected, cut
    assert _streamed(parser, list(reply)) == expected  # a character per delta


FRAGMENTS = ["<tool_call>", "</tool_call>", "<tool_", "\n", " ", "Hi", f"\n{WEATHER}\n", TIME, "{", "}", ";",
             "<|python_tag|>", "[TOOL_CALLS]", f"[{TIME}]", "[TOOL_", '{"name": "x", "parameters": {}}', '"', "é"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(list(Parser)), st.lists(st.sampled_from(FRAGMENTS), max_size=10),
       st.lists(st.integers(0, 400), max_size=6))
def test_stream_on_random_replies_equals_parse(parser, fragments, cuts):
    reply = "".join(fragments)
    cuts = sorted({min(c, len(reply)) for c in cuts})
    pieces = [reply[a:b] for a, b in zip([0, *cuts], [*cuts, len(reply)], strict=True)]
    assert _streamed(parser, pieces) == parse_tool_calls(reply, parser, random.Random(0))


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(list(Parser)), st.text())
def test_any_text_without_calls_is_its_own_content(parser, reply):
    content, calls = parse_tool_calls(reply, parser)
    assert calls or content == reply


@pytest.mark.parametrize(("parser", "reply"), [
    (Parser.HERMES, "<tool_call>" + "[" * 100_000 + "</tool_call>"),
    (Parser.LLAMA3_JSON, '{"name": "f", "parameters": ' + "[" * 100_000),
    (Parser.MISTRAL, "[TOOL_CALLS]" + "[" * 100_000),
])
def test_nesting_deeper_than_the_stack_is_content(parser, reply):
    assert parse_tool_calls(reply, parser) == (reply, [])  # json raises RecursionError there, not ValueError


def test_stream_holds_back_what_may_start_a_call():
    stream = ToolCallStream(Parser.HERMES)
    assert stream.feed("Hello <tool").content == "Hello"
    assert stream.feed("box").content == " <toolbox"
    assert stream.feed("\n\n").content == ""  # whitespace may touch a call
    assert stream.feed("<tool_call>\n{\"name\": \"f\", ").content == ""
    assert stream.finish().content == "\n\n<tool_call>\n{\"name\": \"f\", "  # never closed: content


def test_stream_deltas_are_openai_shaped():
    stream = ToolCallStream(Parser.HERMES, random.Random(1))
    first = stream.feed(f"Sure.\n<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{TIME}")
    last = stream.finish()
    ids = [c.id for c in stream.calls]
    assert first.content == "Sure." and last.content == ""
    assert first.tool_calls == (
        {"index": 0, "id": ids[0], "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Paris", "days": 3}'}})
    assert last.tool_calls == (
        {"index": 1, "id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": ""}},
        {"index": 1, "function": {"arguments": "{}"}})
    assert [c.to_openai() for c in stream.calls][1] == {
        "id": ids[1], "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


def test_call_ids():
    _, calls = parse_tool_calls(f"<tool_call>{WEATHER}</tool_call><tool_call>{TIME}</tool_call>", Parser.HERMES)
    assert all(re.fullmatch(r"call_[A-Za-z0-9]{24}", c.id) for c in calls) and calls[0].id != calls[1].id
    _, calls = parse_tool_calls(f"[TOOL_CALLS][{TIME}]", Parser.MISTRAL)
    assert re.fullmatch(r"[A-Za-z0-9]{9}", calls[0].id)  # Mistral's templates take no other
    seeded = [parse_tool_calls(f"<tool_call>{TIME}</tool_call>", Parser.HERMES, random.Random(7))[1][0].id
              for _ in range(2)]
    assert seeded[0] == seeded[1]


def _streamed(parser: Parser, pieces: list[str]) -> tuple[str | None, list]:
    """The reply streamed in `pieces`, joined as a client joins deltas: (content or None, calls)."""
    stream = ToolCallStream(parser, random.Random(0))
    deltas = [stream.feed(p) for p in pieces] + [stream.finish()]
    content = "".join(d.content for d in deltas)
    calls: dict[int, dict] = {}
    for delta in (t for d in deltas for t in d.tool_calls):
        if "id" in delta:
            assert delta["index"] == len(calls) and delta["function"]["arguments"] == ""
            calls[delta["index"]] = {"id": delta["id"], "name": delta["function"]["name"], "arguments": ""}
        calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
    assert [(c.id, c.name, c.arguments) for c in stream.calls] == [tuple(c.values()) for c in calls.values()]
    return (None if calls and not content else content), stream.calls
