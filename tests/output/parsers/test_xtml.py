"""Kimi K3's XTML output (helios/output/parsers/xtml.py): the think / response channels and the tools channel, read
into the neutral events. Markup is built from helios/core/kimi_encoding.py's literals and, for history calls, by the
encoder itself, so the parser and the encoder cannot drift apart."""

from __future__ import annotations

import json

import pytest

from helios.core.kimi_encoding import (ARGUMENT_CLOSE, CALL_CLOSE, JSON_CLOSE, MESSAGE_CLOSE, RESPONSE_CLOSE,
                                       RESPONSE_OPEN, THINK_CLOSE, THINK_OPEN, TOOLS_CLOSE, TOOLS_OPEN, KimiK3Encoding,
                                       open_tag)
from helios.core.manifest import ReasoningSyntax
from helios.output.events import coalesce
from tests.output.parsers import parser, run, texts, tool

TOOLS = [tool("get_weather", city="string", days="integer"), tool("calc", x="number", flags="array")]
# what the probe records for the kimi_k3 encoder: text-matched channels, output starting inside think
SYNTAX = ReasoningSyntax(open=THINK_OPEN, close=THINK_CLOSE, starts_in_reasoning=True)


def arg(key: str, kind: str | None, value: str) -> str:
    attrs = (("key", key),) + ((("type", kind),) if kind else ())
    return open_tag("argument", attrs) + value + ARGUMENT_CLOSE


def call(name: str, *elements: str, index: int = 1) -> str:
    return open_tag("call", (("tool", name), ("index", index))) + "".join(elements) + CALL_CLOSE


def reply(thought: str, answer: str, *calls: str) -> str:
    """An assistant message as generated after the prompt opened think."""
    tools = TOOLS_OPEN + "".join(calls) + TOOLS_CLOSE if calls else ""
    return thought + THINK_CLOSE + RESPONSE_OPEN + answer + RESPONSE_CLOSE + tools + MESSAGE_CLOSE


def xtml(tools=TOOLS, syntax=SYNTAX, tool_parser="xtml"):
    return parser(tool_parser, "xtml", syntax, tools)


TYPED = call("calc", arg("x", "number", "2.5"), arg("flags", "array", '[1, "b"]'), arg("on", "boolean", "true"),
             arg("none", "null", "null"), arg("meta", "object", '{"unit": "c"}'), arg("note", "string", " 5 \n"))
JSON_CALL = call("get_weather", open_tag("json", (("type", "object"),)) + '{"city": "Rome", "days": 2}' + JSON_CLOSE,
                 index=2)
GOLDEN = reply("Two tools.", "Checking.", TYPED, JSON_CALL)
GOLDEN_EVENTS = [("reasoning", "Two tools."), ("text", "Checking."),
                 ("call", "calc", {"x": 2.5, "flags": [1, "b"], "on": True, "none": None, "meta": {"unit": "c"},
                                   "note": " 5 \n"}),
                 ("call", "get_weather", {"city": "Rome", "days": 2})]
ANSWER_ONLY = reply("Rayleigh.", "Air scatters blue light.")


def test_channels_typed_arguments_and_a_json_element():
    assert texts(run(xtml(), [GOLDEN])) == GOLDEN_EVENTS
    assert texts(run(xtml(), [ANSWER_ONLY])) == [("reasoning", "Rayleigh."), ("text", "Air scatters blue light.")]


def test_string_values_are_verbatim_and_attributes_unescape():
    """A string value keeps markup-like text and surrounding space; &quot; / &amp; in names and keys unescape; an
    untyped value is schema-guided, a typed one whose JSON is invalid falls back to the schema too."""
    text = reply("", "", call('a"b&c', arg('k"1', "string", "<b> & </b>"), arg("days", None, "3"),
                              arg("n", "number", "oops")))
    assert open_tag("call", (("tool", 'a"b&c'),)).startswith('<|open|>call tool="a&quot;b&amp;c"')
    assert texts(run(xtml([tool('a"b&c', days="integer", n="number")]), [text])) == [
        ("call", 'a"b&c', {'k"1': "<b> & </b>", "days": 3, "n": "oops"})]


def test_the_encoders_history_calls_read_back():
    """Calls as the encoder renders them in history (object arguments, text arguments, a JSON-object string, a
    non-object JSON string as the json element) parse into the same calls."""
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
             {"type": "function", "function": {"name": "calc", "arguments": {"flags": [1, {"a": None}], "x": 0.5}}},
             {"type": "function", "function": {"name": "calc", "arguments": ""}}]
    text = reply("need tools", "", *(KimiK3Encoding.call(c, i) for i, c in enumerate(calls, 1)))
    assert texts(run(xtml(), [text])) == [("reasoning", "need tools"),
                                          ("call", "get_weather", {"city": "Oslo", "days": 2}),
                                          ("call", "calc", {"flags": [1, {"a": None}], "x": 0.5}), ("call", "calc", {})]
    bad = KimiK3Encoding.call({"function": {"name": "calc", "arguments": "[1, 2]"}}, 1)
    assert bad.startswith(open_tag("call", (("tool", "calc"), ("index", 1))) + open_tag("json", (("type", "object"),)))
    assert texts(run(xtml(), [reply("", "", bad)])) == [("error", "invalid_call")]  # a call's arguments are an object


def test_channel_variants():
    """The model opening think itself (the hosted API's prompt), skipping think for a response, and output that
    starts in content (a core whose prompt opened nothing) all read the same."""
    assert texts(run(xtml(), [THINK_OPEN + ANSWER_ONLY])) == texts(run(xtml(), [ANSWER_ONLY]))
    assert texts(run(xtml(), [RESPONSE_OPEN + "Hi." + RESPONSE_CLOSE + MESSAGE_CLOSE])) == [("text", "Hi.")]
    starts_in_content = ReasoningSyntax(open=THINK_OPEN, close=THINK_CLOSE)
    assert texts(run(xtml(syntax=starts_in_content), [THINK_OPEN + ANSWER_ONLY])) == texts(run(xtml(), [ANSWER_ONLY]))
    # a tools channel straight after reasoning ends it; text after the tools channel is discarded
    direct = "Plan." + TOOLS_OPEN + call("calc") + TOOLS_CLOSE + MESSAGE_CLOSE + "ignored"
    assert texts(run(xtml(), [direct])) == [("reasoning", "Plan."), ("call", "calc", {})]


def test_without_tool_parsing_the_channels_still_split():
    """tool_choice none / no tools: reasoning and answer separate; a tools channel the model writes anyway is text."""
    p = parser(None, "xtml", SYNTAX, None)
    assert texts(run(p, [ANSWER_ONLY])) == [("reasoning", "Rayleigh."), ("text", "Air scatters blue light.")]
    events = texts(run(parser(None, "xtml", SYNTAX, None), [reply("r", "a", call("calc"))]))
    assert events == [("reasoning", "r"), ("text", "a" + TOOLS_OPEN + call("calc") + TOOLS_CLOSE)]


@pytest.mark.parametrize("bad", [
    call("calc", arg("x", "number", "1"), arg("x", "number", "2")),  # duplicate argument
    call(""),  # empty tool name
    call("calc", arg("", "string", "v")),  # empty argument name
    call("calc", open_tag("argument", (("key", "x"), ("type", "number"))) + "1"),  # argument never closed
    call("calc", "loose text"),  # text that is no element
    call("calc", open_tag("json", (("type", "object"),)) + "[1]" + JSON_CLOSE),  # json element not an object
    call("calc", open_tag("json", (("type", "object"),)) + "{" + JSON_CLOSE),  # invalid JSON
    call("calc", arg("x", "number", "1"), open_tag("json", ()) + "{}" + JSON_CLOSE),  # both forms
    "<|open|>call<|sep|>" + CALL_CLOSE,  # no attributes
])
def test_malformed_calls_are_invalid(bad):
    assert texts(run(xtml(), [reply("r", "", bad)])) == [("reasoning", "r"), ("error", "invalid_call")]


def test_incomplete_at_the_end():
    """An open call at natural completion is an error; cut by the output limit it is omitted. A control token cut
    short at the end of the answer is markup, not text; a tools channel opened without a call holds none (as
    DSML's section)."""
    cut = "r" + THINK_CLOSE + RESPONSE_OPEN + "Hm." + RESPONSE_CLOSE + TOOLS_OPEN + call("calc", arg("x", "number",
                                                                                                    "1"))[:-4]
    assert texts(run(xtml(), [cut])) == [("reasoning", "r"), ("text", "Hm."), ("error", "incomplete_call")]
    assert texts(run(xtml(), [cut], truncated=True)) == [("reasoning", "r"), ("text", "Hm.")]
    partial = "r" + THINK_CLOSE + RESPONSE_OPEN + "Hm." + RESPONSE_CLOSE[:-3]
    assert texts(run(xtml(), [partial])) == [("reasoning", "r"), ("text", "Hm.")]
    assert texts(run(xtml(), ["r" + THINK_CLOSE + TOOLS_OPEN])) == [("reasoning", "r")]
    assert texts(run(xtml(), ["r" + THINK_CLOSE + TOOLS_OPEN + "<|open|>call tool="])) == [("reasoning", "r"),
                                                                                  ("error", "incomplete_call")]


def test_streaming_publishes_at_call_close():
    p = xtml()
    head = "r" + THINK_CLOSE + RESPONSE_OPEN + "Look" + RESPONSE_CLOSE
    assert texts(p.feed(7, head + TOOLS_OPEN[:6])) == [("reasoning", "r"), ("text", "Look")]  # opener held
    assert texts(p.feed(7, TOOLS_OPEN[6:] + call("calc")[:-4])) == []  # the call is still open
    assert texts(p.feed(7, call("calc")[-4:])) == [("call", "calc", {})]
    assert texts(p.feed(7, TOOLS_CLOSE + MESSAGE_CLOSE) + p.finish(False)) == []


@pytest.mark.parametrize("text", [GOLDEN, ANSWER_ONLY, THINK_OPEN + reply("a", "b", call("calc", arg("x", None, "1")))],
                         ids=["calls", "answer", "opens_think"])
def test_every_split_yields_the_same_events(text):
    """The document char by char, and cut in two at every position, parses as it does whole."""

    def events(pieces: list[str]) -> list:
        p = xtml()
        out = []
        for piece in pieces:
            out += p.feed(7, piece)
        return coalesce(out + p.finish(False))

    whole = events([text])
    assert events(list(text)) == whole
    for i in range(1, len(text)):
        assert events([text[:i], text[i:]]) == whole, i
    if text is GOLDEN:
        assert texts(whole) == GOLDEN_EVENTS and json.loads(whole[-1].arguments) == {"city": "Rome", "days": 2}
