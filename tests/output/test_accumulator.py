"""The ordered output accumulator: block events and the buffered view agree; entries wait for their text."""

from __future__ import annotations

from helios.output.accumulator import OutputAccumulator
from helios.output.processor import OutputDelta, TokenEntry


def _entry(token_id: int, offset: int = 0) -> TokenEntry:
    return TokenEntry(token_id, b"x", -0.5, [], offset)


def test_text_block_events_and_buffered_view():
    acc = OutputAccumulator()
    events = acc.add(OutputDelta(text="Hel", entries=[_entry(1)]))
    assert [(e.kind, e.index, e.text) for e in events] == [("start", 0, ""), ("delta", 0, "Hel")]
    assert [e.token_id for e in events[1].entries] == [1]
    # a token whose bytes are still incomplete UTF-8: its entry waits for the text its first byte lands in
    assert acc.add(OutputDelta(text="", entries=[_entry(2)])) == []
    events = acc.add(OutputDelta(text="lo", entries=[_entry(3)]))
    assert [(e.kind, e.text) for e in events] == [("delta", "lo")]
    assert [e.token_id for e in events[0].entries] == [2, 3]
    assert [(e.kind, e.index) for e in acc.close()] == [("stop", 0)]
    assert acc.close() == []
    [block] = acc.blocks
    assert block.kind == "text" and block.text == acc.text == "Hello"
    assert [e.token_id for e in block.entries] == [1, 2, 3]
    assert acc.num_tool_calls == 0


def test_no_text_no_blocks():
    acc = OutputAccumulator()
    assert acc.add(OutputDelta(entries=[_entry(5)], finished=True)) == []
    assert acc.close() == [] and acc.blocks == [] and acc.text == ""
