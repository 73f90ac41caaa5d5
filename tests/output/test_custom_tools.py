"""Completed custom-tool calls over real parser token streams: {"input": string} and its grammar, exact bytes."""

from __future__ import annotations

import json

import pytest

from helios.frontend.grammar import compile_grammar
from helios.output.custom_tools import CustomInputValidator, custom_input
from helios.output.events import ParseError, TextDelta, ToolCall, ToolCallStart, coalesce
from helios.output.tool_choice import ToolChoiceValidator
from helios.output.tool_schema import ToolSchemas, ToolSpec
from tests.output.parsers import counter_ids

INPUT_ONLY = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
SCHEMAS = ToolSchemas([ToolSpec("lookup", INPUT_ONLY), ToolSpec("crm__note", INPUT_ONLY, "crm"),
                       ToolSpec("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}})])
PHONE = compile_grammar("regex", r"\d{3}-\d{4}")


def _qwen(name: str, value: str, param: str = "input") -> str:
    return f"<tool_call>\n<function={name}>\n<parameter={param}>\n{value}\n</parameter>\n</function>\n</tool_call>"


def _hermes(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def _run(syntax: str, text: str, piece: int = 1, mode: str = "auto") -> list:
    from helios.output.parsers import build

    p = build(syntax, None, None, SCHEMAS, new_call_id=counter_ids())
    custom = CustomInputValidator({"lookup": PHONE, "crm__note": None})
    choice = ToolChoiceValidator(mode, ["lookup", "crm__note", "get_weather"])  # type: ignore[arg-type]
    out = []
    for i in range(0, len(text), piece):
        out += choice.filter(custom.filter(p.feed(7, text[i:i + piece])))
    out += choice.filter(custom.filter(p.finish(False)))
    out += choice.finish()
    return coalesce(out)


@pytest.mark.parametrize("syntax", ["qwen_xml", "hermes"])
@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_valid_input_passes_whole(syntax, piece):
    call = _qwen("lookup", "555-1234") if syntax == "qwen_xml" else _hermes("lookup", {"input": "555-1234"})
    events = _run(syntax, "Sure.\n" + call, piece)
    assert events[0] == TextDelta("Sure.\n")
    [ev] = [e for e in events if isinstance(e, ToolCall)]
    assert ev.name == "lookup" and custom_input(ev.arguments) == "555-1234" and ev.namespace is None


def test_exact_bytes_include_inner_whitespace_and_unicode():
    # Qwen strips one wrapping newline; what is left is the input, byte for byte
    events = _run("qwen_xml", _qwen("crm__note", "  two\n\nlines é  "))
    [ev] = [e for e in events if isinstance(e, ToolCall)]
    assert custom_input(ev.arguments) == "  two\n\nlines é  " and ev.namespace == "crm"
    bad = _run("qwen_xml", _qwen("lookup", "555-1234 "))  # one trailing space is not the grammar's
    assert isinstance(bad[-1], ParseError) and "byte 8" in bad[-1].message
    assert not any(isinstance(e, ToolCall) for e in bad)


def test_invalid_call_is_never_emitted_and_ends_the_output():
    text = _hermes("lookup", {"input": "12-34"}) + "\n" + _hermes("get_weather", {"city": "Paris"}) + " more"
    events = _run("hermes", text, 3)
    # ToolCallStart shows nothing; the rejected call and all that follows it never appear
    assert [type(e) for e in events] == [ToolCallStart, ParseError]
    assert events[1].kind == "invalid_call" and "regex grammar: byte 2" in events[1].message


@pytest.mark.parametrize("arguments", [{}, {"input": 5}, {"input": "555-1234", "extra": 1}, {"text": "x"}])
def test_arguments_must_be_exactly_one_input_string(arguments):
    events = _run("hermes", _hermes("crm__note", arguments))
    assert isinstance(events[-1], ParseError) and "exactly one string argument 'input'" in events[-1].message


def test_function_tools_are_not_checked():
    events = _run("hermes", _hermes("get_weather", {"city": "Paris"}) + _hermes("other", {"input": 1}))
    assert [e.name for e in events if isinstance(e, ToolCall)] == ["get_weather", "other"]


def test_required_mode_does_not_count_a_rejected_call():
    events = _run("hermes", _hermes("lookup", {"input": "nope"}), mode="required")
    assert [e.kind for e in events if isinstance(e, ParseError)] == ["invalid_call"]  # no second error
