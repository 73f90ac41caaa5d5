"""The ordered event accumulator: blocks in generation order, SSE block events agree with the buffered view."""

from __future__ import annotations

import json

from tests.output.parsers import THINK_CLOSE, parser, think_syntax, tool

from helios.output.event_accumulator import EventAccumulator
from helios.output.events import ParseError, ReasoningDelta, TextDelta, ToolCall
from helios.output.processor import TokenEntry


def _entry(token_id: int) -> TokenEntry:
    return TokenEntry(token_id, b"x", -0.5, [], 0)


def test_blocks_keep_generation_order():
    acc = EventAccumulator()
    events = acc.add([ReasoningDelta("think"), ReasoningDelta("ing"), TextDelta("Hi"),
                      ToolCall(0, "call_0", "f", '{"a":1}'), TextDelta("bye")])
    events += acc.close()
    assert [(b.kind, b.text) for b in acc.blocks] == [("reasoning", "thinking"), ("text", "Hi"),
                                                     ("tool_call", '{"a":1}'), ("text", "bye")]
    assert [(e.kind, e.index) for e in events] == [
        ("start", 0), ("delta", 0), ("delta", 0), ("stop", 0), ("start", 1), ("delta", 1), ("stop", 1),
        ("start", 2), ("delta", 2), ("stop", 2), ("start", 3), ("delta", 3), ("stop", 3)]
    tool_block = acc.blocks[2]
    assert (tool_block.name, tool_block.call_id) == ("f", "call_0") and acc.num_tool_calls == 1
    assert acc.text == "Hibye" and acc.reasoning == "thinking"
    # replaying the deltas per block rebuilds the buffered view (what an SSE client reassembles)
    rebuilt: dict[int, str] = {}
    for e in events:
        if e.kind == "delta":
            rebuilt[e.index] = rebuilt.get(e.index, "") + e.text
    assert [rebuilt[i] for i in range(4)] == [b.text for b in acc.blocks]


def test_blank_text_between_calls_opens_no_block():
    acc = EventAccumulator()
    acc.add([ToolCall(0, "a", "f", "{}"), TextDelta("\n"), ToolCall(1, "b", "f", "{}"), TextDelta("\n")])
    acc.add([ReasoningDelta("\n"), ReasoningDelta("r")])
    acc.close()
    assert [(b.kind, b.text) for b in acc.blocks] == [("tool_call", "{}"), ("tool_call", "{}"), ("reasoning", "\nr")]


def test_parse_error_is_terminal():
    acc = EventAccumulator()
    events = acc.add([TextDelta("a"), ParseError("incomplete_call", "x"), TextDelta("b")])
    assert acc.error is not None and acc.error.kind == "incomplete_call"
    assert [e.kind for e in events] == ["start", "delta", "stop"] and acc.text == "a"
    assert acc.add([TextDelta("c")]) == []


def test_entries_follow_the_text_they_belong_to():
    acc = EventAccumulator()
    acc.add([], [_entry(1)])  # a delimiter or envelope token: no text yet
    acc.add([TextDelta("x")], [_entry(2)])
    acc.add([ToolCall(0, "c", "f", "{}")], [_entry(3)])
    assert [[e.token_id for e in b.entries] for b in acc.blocks] == [[1, 2], [3]]


def test_end_to_end_qwen_stream_into_blocks():
    tools = [tool("get_weather", city="string")]
    p = parser("qwen_xml", "think", think_syntax(starts_in_reasoning=True), tools)
    acc = EventAccumulator()
    stream = ["Need weather.", (THINK_CLOSE, "</think>"), "\n\n", "Checking.\n", "<tool_call>",
              "\n<function=get_weather>",
              "\n<parameter=city>\nParis\n</parameter>\n</function>", "\n</tool_call>", "\n"]
    for piece in stream:
        token_id, text = (7, piece) if isinstance(piece, str) else piece
        acc.add(p.feed(token_id, text))
    acc.add(p.finish())
    acc.close()
    assert [b.kind for b in acc.blocks] == ["reasoning", "text", "tool_call"]
    assert acc.blocks[1].text == "\n\nChecking.\n" and json.loads(acc.blocks[2].text) == {"city": "Paris"}
