"""DeepSeek V4 and V4.1 DSML tool calls (dsml_v4, dsml_v41): the tag spellings the native encoders teach
(helios/core/deepseek_encoding.py), read back into calls. Tags are built from the encoders' own tag names, so the
parser and the encoder cannot drift apart. V3.2's `dsml` keeps its tests in test_other_syntaxes.py."""

from __future__ import annotations

import json

import pytest

from helios.core.deepseek_encoding import DSML, native_encoder
from helios.output.events import coalesce
from tests.output.parsers import parser, run, texts, tool

TOOLS = [tool("get_weather", city="string", days="integer"), tool("calc", x="number", flags="array")]
PARSERS = {"deepseek_v4": "dsml_v4", "deepseek_v41": "dsml_v41"}
KINDS = sorted(PARSERS)


class Tags:
    """One spelling's tags, from its encoder's tag names."""

    def __init__(self, kind: str):
        enc = native_encoder(kind)
        self.open, self.close = f"<{DSML}{enc.calls_tag}>", f"</{DSML}{enc.calls_tag}>"
        self.invoke, self.end_invoke = f"<{DSML}{enc.invoke_tag}", f"</{DSML}{enc.invoke_tag}>"
        self.param, self.end_param = f"<{DSML}{enc.param_tag}", f"</{DSML}{enc.param_tag}>"

    def call(self, name: str, *params: tuple[str, str | None, str]) -> str:
        """<invoke name=...> with (key, string attribute or None, raw value) parameters."""
        body = "".join(f'{self.param} name="{k}"' + (f' string="{s}"' if s else "") + f">{v}{self.end_param}\n"
                       for k, s, v in params)
        return f'{self.invoke} name="{name}">\n{body}{self.end_invoke}\n'

    def section(self, *calls: str) -> str:
        return self.open + "\n" + "".join(calls) + self.close


V32 = f'<{DSML}function_calls>\n<{DSML}invoke name="calc">\n</{DSML}invoke>\n</{DSML}function_calls>'


def _doc(tags: Tags) -> str:
    """Prose, two calls (string="true" / "false" / schema-guided values), the section close, dropped text."""
    weather = tags.call("get_weather", ("city", "true", "  Paris "), ("days", "false", "5"))
    calc = tags.call("calc", ("flags", "false", '[1, "b"]'), ("x", None, "2.5"))
    return "Sure.\n\n" + tags.section(weather, calc) + "trailing text dropped"


DOC_EVENTS = [("text", "Sure.\n\n"), ("call", "get_weather", {"city": "  Paris ", "days": 5}),
              ("call", "calc", {"flags": [1, "b"], "x": 2.5})]


@pytest.mark.parametrize("kind", KINDS)
def test_one_call_and_two_calls_with_string_attributes(kind):
    tags = Tags(kind)
    one = tags.section(tags.call("get_weather", ("city", "true", "5"), ("days", "false", "5")))
    assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [one])) == [
        ("call", "get_weather", {"city": "5", "days": 5})]  # string="true" keeps "5" text even against the schema
    assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [_doc(tags)])) == DOC_EVENTS


@pytest.mark.parametrize("kind", KINDS)
def test_the_encoders_history_calls_read_back(kind):
    """What the encoder writes for a history call (after reasoning and content) parses into the same call."""
    encoder = native_encoder(kind)
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}},
             {"type": "function", "function": {"name": "calc", "arguments": {"flags": [1, {"a": None}], "x": 0.5}}}]
    text = "<think>need tools</think>Checking.\n\n" + encoder.calls_block(calls)
    events = texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [text]))
    assert events == [("reasoning", "need tools"), ("text", "Checking.\n\n"),
                      ("call", "get_weather", {"city": "Oslo", "days": 2}),
                      ("call", "calc", {"flags": [1, {"a": None}], "x": 0.5})]


@pytest.mark.parametrize("kind", KINDS)
def test_closing_the_section_ends_output(kind):
    tags = Tags(kind)
    p = parser(PARSERS[kind], "dsml", tools=TOOLS)
    later = ["<think>more</think>", "words ", tags.section(tags.call("calc"))]
    assert texts(run(p, [tags.section(tags.call("calc")), *later])) == [("call", "calc", {})]


@pytest.mark.parametrize("kind", KINDS)
def test_prose_mentions_and_the_other_spellings_are_text(kind):
    """Invoke / parameter tags outside a section are prose; so is every spelling the core's encoder does not
    teach (V3.2's function_calls, and V4's tool_calls on V4.1 or V4.1's spaced calls on V4)."""
    tags, other = Tags(kind), Tags(next(k for k in KINDS if k != kind))
    prose = f'Write {tags.invoke} name="calc"> then {tags.param} name="x">1{tags.end_param}{tags.end_invoke} inside.'
    for text in (prose, V32, other.section(other.call("calc", ("x", "false", "1")))):
        assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [text])) == [("text", text)]
    # and V3.2's parser leaves the native spellings alone
    native = tags.section(tags.call("calc"))
    assert texts(run(parser("dsml", "dsml", tools=TOOLS), [native])) == [("text", native)]


@pytest.mark.parametrize("kind", KINDS)
def test_incomplete_at_the_end(kind):
    """An open invoke at natural completion is an error; cut by the output limit it is omitted. A partial
    section opener at the end is plain text."""
    tags = Tags(kind)
    open_call = "Hm." + tags.open + "\n" + f'{tags.invoke} name="calc">\n{tags.param} name="x" string="false">1'
    assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [open_call])) == [("text", "Hm."),
                                                                                  ("error", "incomplete_call")]
    assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [open_call], truncated=True)) == [("text", "Hm.")]
    partial = "Hm." + tags.open[:-2]
    assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [partial])) == [("text", partial)]


@pytest.mark.parametrize("kind", KINDS)
def test_names_and_argument_names_are_validated(kind):
    tags = Tags(kind)
    for bad in (tags.call("calc", ("x", "false", "2"), ("x", "false", "3")), tags.call(""),
                tags.call("calc", ("", "true", "v"))):
        assert texts(run(parser(PARSERS[kind], "dsml", tools=TOOLS), [tags.section(bad)])) == [
            ("error", "invalid_call")]


@pytest.mark.parametrize("kind", KINDS)
def test_streaming_publishes_at_invoke_close_and_holds_partial_tags(kind):
    tags = Tags(kind)
    p = parser(PARSERS[kind], "dsml", tools=TOOLS)
    assert texts(p.feed(7, "Look: " + tags.open[:5])) == [("text", "Look: ")]  # the partial opener is held back
    assert texts(p.feed(7, tags.open[5:] + "\n" + tags.call("calc")[:-4])) == []  # the call is still open
    assert texts(p.feed(7, tags.call("calc")[-4:])) == [("call", "calc", {})]  # published before the close
    assert texts(p.feed(7, tags.close) + p.finish(False)) == []


@pytest.mark.parametrize("kind", KINDS)
def test_every_split_yields_the_same_events(kind):
    """The document char by char, and cut in two at every position, parses as it does whole."""
    text = "<think>plan</think>" + _doc(Tags(kind))

    def events(pieces: list[str]) -> list:
        p = parser(PARSERS[kind], "dsml", tools=TOOLS)
        out = []
        for piece in pieces:
            out += p.feed(7, piece)
        return coalesce(out + p.finish(False))

    whole = events([text])
    assert texts(whole) == [("reasoning", "plan"), *DOC_EVENTS]
    assert events(list(text)) == whole
    for i in range(1, len(text)):
        assert events([text[:i], text[i:]]) == whole, i
    assert json.loads(whole[-1].arguments) == {"flags": [1, "b"], "x": 2.5}
