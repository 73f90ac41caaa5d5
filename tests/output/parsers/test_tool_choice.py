"""tool_choice validation over parser events: required, named, parallel_tool_calls false, auto."""

from __future__ import annotations

from tests.output.parsers import parser, texts, tool

from helios.output.events import ParseError, TextDelta, ToolCall, ToolCallStart, coalesce
from helios.output.tool_choice import ToolChoiceValidator

TOOLS = [tool("get_weather", city="string"), tool("lookup", q="string")]
DECLARED = ["get_weather", "lookup"]


def _call(name: str, city: str = "Paris") -> str:
    return f"<tool_call>\n<function={name}>\n<parameter=city>\n{city}\n</parameter>\n</function>\n</tool_call>"


def _validate(validator: ToolChoiceValidator, stream: list[str], truncated: bool = False) -> list:
    p = parser("qwen_xml", tools=TOOLS)
    out = []
    for piece in stream:
        out += validator.filter(p.feed(7, piece))
    out += validator.filter(p.finish(truncated))
    out += validator.finish()
    return coalesce(out)


def test_auto_returns_undeclared_calls_as_is():
    v = ToolChoiceValidator("auto", DECLARED)
    assert texts(_validate(v, ["Hi ", _call("web_search", "x")])) == [("text", "Hi "),
                                                                      ("call", "web_search", {"city": "x"})]


def test_required_needs_a_completed_call_to_a_declared_tool():
    v = ToolChoiceValidator("required", DECLARED)
    assert texts(_validate(v, [_call("get_weather")])) == [("call", "get_weather", {"city": "Paris"})]
    v = ToolChoiceValidator("required", DECLARED)
    assert texts(_validate(v, ["No tools needed."])) == [("text", "No tools needed."), ("error", "tool_choice")]
    v = ToolChoiceValidator("required", DECLARED)  # an undeclared call does not satisfy it
    assert texts(_validate(v, [_call("other")]))[-1] == ("error", "tool_choice")


def test_required_fails_when_truncated_before_a_complete_call():
    v = ToolChoiceValidator("required", DECLARED)
    events = _validate(v, ["ok ", _call("get_weather")[:40]], truncated=True)
    assert texts(events) == [("text", "ok "), ("error", "tool_choice")]


def test_named_hides_answer_text_and_rejects_another_tool_before_emitting_it():
    v = ToolChoiceValidator("named", DECLARED, named="get_weather")
    events = _validate(v, ["Sure! ", _call("get_weather"), " done"])
    assert texts(events) == [("call", "get_weather", {"city": "Paris"})]
    assert not any(isinstance(e, TextDelta) for e in events)
    v = ToolChoiceValidator("named", DECLARED, named="get_weather")
    events = _validate(v, [_call("get_weather"), _call("lookup")])
    assert texts(events) == [("call", "get_weather", {"city": "Paris"}), ("error", "tool_choice")]
    # the failing call never reaches the encoder: no start and no call event for it
    assert [e.name for e in events if isinstance(e, (ToolCallStart, ToolCall))] == ["get_weather", "get_weather"]


def test_named_without_a_call_fails():
    v = ToolChoiceValidator("named", DECLARED, named="lookup")
    assert texts(_validate(v, ["I refuse."])) == [("error", "tool_choice")]


def test_parallel_false_fails_when_a_second_call_begins():
    v = ToolChoiceValidator("auto", DECLARED, parallel_tool_calls=False)
    first, second = _call("get_weather", "A"), _call("get_weather", "B")
    events = _validate(v, [first, "\n", second[:35], second[35:]])
    assert texts(events) == [("call", "get_weather", {"city": "A"}), ("text", "\n"), ("error", "tool_choice")]
    assert isinstance(events[-1], ParseError) and "second" in events[-1].message
    # the error comes as soon as the second call begins: no event of it, however far it got
    p = parser("qwen_xml", tools=TOOLS)
    v = ToolChoiceValidator("required", DECLARED, parallel_tool_calls=False)
    assert not any(isinstance(e, ParseError) for e in v.filter(p.feed(7, first + second[:30])))  # undecided yet
    out = v.filter(p.feed(7, second[30:50]))
    assert [type(e) for e in out] == [ParseError]


def test_parse_errors_pass_through_and_end_validation():
    v = ToolChoiceValidator("required", DECLARED)
    events = _validate(v, ["<function=get_weather><parameter=city>x"])  # incomplete at natural end
    assert texts(events) == [("error", "incomplete_call")]
