"""Qwen function tags (qwen_xml) and MiMo compact tags: the spec's recognition rules, case by case."""

from __future__ import annotations

import json

from tests.output.parsers import THINK_CLOSE, parser, run, texts, think_syntax, tool

from helios.output.events import MAX_ARGUMENT_BYTES, ParseError, ToolCall, ToolCallStart

WEATHER = [tool("get_weather", city="string", days="integer", metric="boolean", extra="object")]
CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")


def _tokens(text: str, size: int = 3) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def test_call_in_answer_with_outer_tags():
    p = parser("qwen_xml", tools=WEATHER)
    events = run(p, _tokens("Checking.\n\n" + CALL))
    assert texts(events) == [("text", "Checking.\n\n"), ("call", "get_weather", {"city": "Paris", "days": 3})]
    start = next(e for e in events if isinstance(e, ToolCallStart))
    assert start.name == "get_weather" and start.index == 0
    call = next(e for e in events if isinstance(e, ToolCall))
    assert call.id == "call_0" and call.arguments == '{"city":"Paris","days":3}'


def test_omitted_outer_tags_in_answer():
    p = parser("qwen_xml", tools=WEATHER)
    text = "<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\nThat is all."
    assert texts(run(p, _tokens(text))) == [("call", "get_weather", {"city": "Rome"}), ("text", "\nThat is all.")]


def test_quoted_tags_in_prose_stay_text():
    p = parser("qwen_xml", tools=WEATHER)
    text = "Wrap calls in <tool_call> tags; a header looks like <function=name> followed by parameters."
    assert texts(run(p, _tokens(text, 2))) == [("text", text)]
    p = parser("qwen_xml", tools=WEATHER)
    text = "Write `<function=get_weather>` then `<parameter=city>`."
    assert texts(run(p, _tokens(text))) == [("text", text)]


def test_quoted_tag_in_reasoning_stays_reasoning():
    p = parser("qwen_xml", "think", think_syntax(starts_in_reasoning=True), WEATHER)
    events = run(p, ["The format is <tool_call> then JSON.", (THINK_CLOSE, "</think>"), "Hi"])
    assert texts(events) == [("reasoning", "The format is <tool_call> then JSON."), ("text", "Hi")]


def test_tool_call_is_implicit_end_of_reasoning():
    p = parser("qwen_xml", "think", think_syntax(starts_in_reasoning=True), WEATHER)
    events = run(p, ["I should look it up.\n"] + _tokens(CALL) + ["\n"])
    assert texts(events) == [("reasoning", "I should look it up.\n"),
                             ("call", "get_weather", {"city": "Paris", "days": 3}), ("text", "\n")]
    assert not p.in_reasoning


def test_complete_call_written_in_prose_inline_parses_and_ends_reasoning():
    p = parser("qwen_xml", "think", think_syntax(starts_in_reasoning=True), WEATHER)
    text = "so I call <function=get_weather><parameter=city>Oslo</parameter></function> and wait"
    events = run(p, _tokens(text, 4))
    assert texts(events) == [("reasoning", "so I call "), ("call", "get_weather", {"city": "Oslo"}),
                             ("text", " and wait")]


def test_missing_parameter_close_is_closed_by_next_boundary():
    p = parser("qwen_xml", tools=WEATHER)
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n<parameter=days>\n2\n"
            "</function>\n</tool_call>")
    assert texts(run(p, _tokens(text))) == [("call", "get_weather", {"city": "Paris", "days": 2})]


def test_one_wrapping_newline_removed_on_each_side():
    p = parser("qwen_xml", tools=WEATHER)
    text = "<function=get_weather>\n<parameter=city>\n\n  two lines\nhere\n\n</parameter>\n</function>"
    assert texts(run(p, [text])) == [("call", "get_weather", {"city": "\n  two lines\nhere\n"})]


def test_mimo_values_verbatim():
    p = parser("mimo", tools=WEATHER)
    text = "<tool_call><function=get_weather><parameter=city>\n  Paris\n</parameter></function></tool_call>"
    assert texts(run(p, _tokens(text))) == [("call", "get_weather", {"city": "\n  Paris\n"})]


def test_schema_conversion_and_invalid_values_kept():
    p = parser("qwen_xml", tools=WEATHER)
    text = ("<function=get_weather><parameter=days>many</parameter><parameter=metric>True</parameter>"
            '<parameter=extra>{"a": [1, 2]}</parameter><parameter=city>42</parameter></function>')
    [call] = texts(run(p, [text]))
    assert call == ("call", "get_weather", {"days": "many", "metric": True, "extra": {"a": [1, 2]}, "city": "42"})


def test_undeclared_tool_returned_as_is_without_conversion():
    p = parser("qwen_xml", tools=WEATHER)
    text = "<function=lookup><parameter=n>7</parameter></function>"
    assert texts(run(p, [text])) == [("call", "lookup", {"n": "7"})]


def test_two_calls_in_order_with_text():
    p = parser("qwen_xml", tools=WEATHER)
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nA\n</parameter>\n</function>\n</tool_call>"
    events = run(p, _tokens("x " + one + "\n" + one.replace(">\nA\n<", ">\nB\n<") + " y"))
    # the parser is faithful: the newline between the envelopes is text (the accumulator drops blank blocks)
    assert texts(events) == [("text", "x "), ("call", "get_weather", {"city": "A"}), ("text", "\n"),
                             ("call", "get_weather", {"city": "B"}), ("text", " y")]
    assert [e.index for e in events if isinstance(e, ToolCall)] == [0, 1]


def test_incomplete_call_at_natural_completion_is_an_error():
    p = parser("qwen_xml", tools=WEATHER)
    events = run(p, _tokens("<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"))
    assert texts(events)[-1] == ("error", "incomplete_call")
    assert not any(isinstance(e, ToolCall) for e in events)


def test_undecided_tag_at_natural_completion_is_an_incomplete_call():
    p = parser("qwen_xml", tools=WEATHER)
    assert texts(run(p, ["Sure: ", "<tool_call>", "\n<function=get"])) == [("text", "Sure: "),
                                                                         ("error", "incomplete_call")]


def test_truncated_envelope_at_the_limit_is_omitted():
    p = parser("qwen_xml", tools=WEATHER)
    events = run(p, _tokens("Let me check. " + CALL[:60]), truncated=True)
    assert texts(events) == [("text", "Let me check. ")]
    p = parser("qwen_xml", tools=WEATHER)
    assert texts(run(p, ["ok <tool_call>\n<func"], truncated=True)) == [("text", "ok ")]


def test_partial_opener_at_the_end_is_text():
    p = parser("qwen_xml", tools=WEATHER)
    assert texts(run(p, ["see <tool_ca"])) == [("text", "see <tool_ca")]


def test_arguments_bounded_to_8_mib():
    p = parser("qwen_xml", tools=WEATHER)
    big = "x" * (MAX_ARGUMENT_BYTES - 10)  # {"city":"..."} adds 11 bytes: one over the bound
    events = run(p, ["<function=get_weather><parameter=city>", big, "</parameter></function>"])
    assert [type(e) for e in events] == [ToolCallStart, ParseError]
    assert events[-1].kind == "too_large"
    p = parser("qwen_xml", tools=WEATHER)
    fits = "x" * (MAX_ARGUMENT_BYTES - 11)  # {"city":"..."} is exactly 8 MiB
    [_, call] = run(p, ["<function=get_weather><parameter=city>", fits, "</parameter></function>"])
    assert len(call.arguments.encode()) == MAX_ARGUMENT_BYTES and json.loads(call.arguments)["city"] == fits


def test_unbounded_envelope_fails_early_without_waiting_for_its_close():
    p = parser("qwen_xml", tools=WEATHER, max_argument_bytes=1000)
    events = []
    events += p.feed(7, "<function=get_weather><parameter=city>")
    for _ in range(200):
        events += p.feed(7, "y" * 500)
        if p.failed:
            break
    assert isinstance(events[-1], ParseError) and events[-1].kind == "too_large"
    assert p.feed(7, "</parameter></function>") == [] and p.finish() == []


def test_duplicate_parameter_is_invalid():
    p = parser("qwen_xml", tools=WEATHER)
    text = "<function=get_weather><parameter=city>a</parameter><parameter=city>b</parameter></function>"
    assert texts(run(p, [text])) == [("error", "invalid_call")]


def test_long_call_in_many_small_tokens_is_linear():
    import time

    p = parser("qwen_xml", tools=WEATHER)
    started = time.perf_counter()
    events = p.feed(7, "<function=get_weather><parameter=city>")
    for _ in range(250_000):  # 1 MB of argument text, 4 chars a token
        events += p.feed(7, "ab\n<")
    events += p.feed(7, "</parameter></function>") + p.finish()
    assert time.perf_counter() - started < 20  # quadratic buffering would take minutes
    call = events[-1]
    assert isinstance(call, ToolCall) and len(json.loads(call.arguments)["city"]) == 1_000_000


def test_tool_undecided_while_an_opener_waits_for_its_header():
    p = parser("qwen_xml", "think", think_syntax(starts_in_reasoning=True), WEATHER)
    p.feed(7, "maybe <tool_call>\n<function=get")
    assert p.tool_undecided and p.in_reasoning
    p.feed(7, "_weather>\n<parameter=city>")
    assert p.tool_undecided and not p.in_reasoning  # confirmed: the call ended reasoning
    p.feed(7, "x</parameter></function>")
    assert not p.tool_undecided
