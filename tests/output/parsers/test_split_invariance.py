"""Property: for text-matched syntaxes, ANY split of the same text into deltas yields the same events.

Compared after coalescing adjacent text/reasoning deltas (how a delta is split is not an event); call
ids come from a counter, so they must agree too. Runs every tool syntax with its text-matched reasoning.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.output.parsers import counter_ids, think_syntax, tool

from helios.core.manifest import ReasoningSyntax
from helios.output.events import coalesce
from helios.output.parsers import make_reasoning_parser, make_tool_parser
from helios.output.parsers.pipeline import OutputParser
from helios.output.tool_schema import ToolSchemas

B = "\uff5c"
TOOLS = ToolSchemas.from_tools([tool("get_weather", city="string", days="integer"), tool("f", x="number")])

# syntax -> (reasoning parser, open, close, fragments the random texts are built from, well-formed documents)
CASES = {
    "qwen_xml": ("think", "<think>", "</think>", [
        "<tool_call>", "</tool_call>", "<function=", "get_weather", ">", "<parameter=", "city", "</parameter>",
        "</function>", "\n", " ", "Paris", "<", "=", "<think>", "</think>", "3", "days"], [
        "plan <tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>",
        "<think>a <tool_call> b</think>x <function=f><parameter=x>1.5</function> <function=f></function>y",
        "quoted <function=get_weather> and <tool_call> tags </think> then <function=f><parameter=x>\n2\n</parameter>",
    ]),
    "mimo": ("think", "<think>", "</think>", ["<function=", "f", ">", "<parameter=", "x", "</parameter>",
                                              "</function>", "\n", " 1 ", "</think>"], [
        "</think><tool_call><function=f><parameter=x>\n 1\n</parameter></function></tool_call> ok"]),
    "glm": ("glm", "<think>", "</think>", [
        "<tool_call>", "</tool_call>", "get_weather", "<arg_key>", "city", "</arg_key>", "<arg_value>", "Paris",
        "</arg_value>", "\n", " ", "</think>"], [
        "r</think>a<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>b",
        "<tool_call> is quoted <tool_call>f</tool_call>"]),
    "hermes": ("think", "<think>", "</think>", ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"f"',
                                               '"arguments"', ",", " ", "\n", "</think>"], [
        '</think>\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n<tool_call> no',
        'a <tool_call>{"name": "get_weather", "arguments": {}}</tool_call>']),
    "gemma4": ("gemma4", "<|channel>thought", "<channel|>", [
        "<|tool_call>", "<tool_call|>", "call:", "f", "{", "}", "x", ":", "1", '<|"|>', ",", "<|channel>",
        "thought", "<channel|>", " "], [
        "<|channel>thought\nhm<channel|>ok <|tool_call>call:f{x:1}<tool_call|><|tool_call>call:get_weather{"
        'city:<|"|>a, b<|"|>}<tool_call|>']),
    "minimax": ("minimax", "<mm:think>", "</mm:think>", [
        "<minimax:tool_call>", "</minimax:tool_call>", '<invoke name="f">', "</invoke>", '<parameter name="x">',
        "</parameter>", "2", "\n", " ", "</mm:think>"], [
        '</mm:think>x\n<minimax:tool_call>\n<invoke name="f">\n<parameter name="x">2</parameter>\n</invoke>\n'
        '</minimax:tool_call> after']),
    "dsml": ("dsml", "<think>", "</think>", [
        f"<{B}DSML{B}function_calls>", f"</{B}DSML{B}function_calls>", f'<{B}DSML{B}invoke name="f">',
        f"</{B}DSML{B}invoke>", f'<{B}DSML{B}parameter name="x" string="false">', f"</{B}DSML{B}parameter>",
        "3", "\n", "<think>", "</think>"], [
        f'<think>p</think>a<{B}DSML{B}function_calls>\n<{B}DSML{B}invoke name="f">\n<{B}DSML{B}parameter '
        f'name="x" string="false">3</{B}DSML{B}parameter>\n</{B}DSML{B}invoke>\n</{B}DSML{B}function_calls>z']),
    "dsml_v4": ("dsml", "<think>", "</think>", [
        f"<{B}DSML{B}tool_calls>", f"</{B}DSML{B}tool_calls>", f"<{B}DSML{B}function_calls>",
        f'<{B}DSML{B}invoke name="f">', f"</{B}DSML{B}invoke>", f'<{B}DSML{B}parameter name="x" string="false">',
        f"</{B}DSML{B}parameter>", "3", "\n", "<think>", "</think>"], [
        f'<think>p</think>a<{B}DSML{B}tool_calls>\n<{B}DSML{B}invoke name="f">\n<{B}DSML{B}parameter '
        f'name="x" string="false">3</{B}DSML{B}parameter>\n</{B}DSML{B}invoke>\n</{B}DSML{B}tool_calls>z']),
    "dsml_v41": ("dsml", "<think>", "</think>", [
        f"<{B}DSML{B} calls>", f"</{B}DSML{B} calls>", f"<{B}DSML{B}tool_calls>", f'<{B}DSML{B} invoke name="f">',
        f"</{B}DSML{B} invoke>", f'<{B}DSML{B} parameter name="x" string="false">', f"</{B}DSML{B} parameter>",
        f'<{B}DSML{B}invoke name="f">', "3", "\n", " ", "<think>", "</think>"], [
        f'<think>p</think>a<{B}DSML{B} calls>\n<{B}DSML{B} invoke name="f">\n<{B}DSML{B} parameter '
        f'name="x" string="false">3</{B}DSML{B} parameter>\n</{B}DSML{B} invoke>\n</{B}DSML{B} calls>z']),
    "kimi": ("think", "<think>", "</think>", [
        "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "functions.f:0",
        "<|tool_call_argument_begin|>", '{"x": 1}', "<|tool_call_end|>", " "], [
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"x": 1}'
        '<|tool_call_end|><|tool_calls_section_end|>']),
    "step": ("think", "<think>", "</think>", [
        "<|tool_calls_begin|>", "<|tool_calls_end|>", "<|tool_call_begin|>", "<|tool_call_end|>",
        'function<|tool_sep|><steptml:invoke name="f">', '<steptml:parameter name="x">', "1",
        "</steptml:parameter>", "</steptml:invoke>", " "], [
        '<|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|><steptml:invoke name="f"><steptml:parameter'
        ' name="x">1</steptml:parameter></steptml:invoke><|tool_call_end|><|tool_calls_end|>']),
    "xtml": ("xtml", "<|open|>think<|sep|>", "<|close|>think<|sep|>", [
        "<|open|>think<|sep|>", "<|close|>think<|sep|>", "<|open|>response<|sep|>", "<|close|>response<|sep|>",
        "<|open|>tools<|sep|>", "<|close|>tools<|sep|>", '<|open|>call tool="f" index="1"<|sep|>',
        '<|open|>argument key="x" type="number"<|sep|>', "<|close|>argument<|sep|>", "<|close|>call<|sep|>",
        "<|close|>message<|sep|>", "<|open|>", "<|close|>", "<|sep|>", "1", " "], [
        'r<|close|>think<|sep|><|open|>response<|sep|>a<|close|>response<|sep|><|open|>tools<|sep|><|open|>call '
        'tool="f" index="1"<|sep|><|open|>argument key="x" type="number"<|sep|>1<|close|>argument<|sep|>'
        '<|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>z']),
}


def _make(syntax_name: str, starts_in_reasoning: bool) -> OutputParser:
    reasoning, open_, close, _, _ = CASES[syntax_name]
    # NOTE: no token ids: every delimiter is text-matched, so splitting text must not matter
    syntax = ReasoningSyntax(open=open_, close=close, starts_in_reasoning=starts_in_reasoning)
    return OutputParser(make_reasoning_parser(reasoning, syntax), make_tool_parser(syntax_name, TOOLS),
                        counter_ids())


def _events(name: str, starts: bool, pieces: list[str], truncated: bool) -> list:
    p = _make(name, starts)
    out = []
    for piece in pieces:
        out += p.feed(7, piece)
    return coalesce(out + p.finish(truncated))


@st.composite
def _split_text(draw, name: str | None = None):
    name = name or draw(st.sampled_from(sorted(CASES)))
    _, _, _, fragments, docs = CASES[name]
    if draw(st.booleans()):
        text = draw(st.sampled_from(docs))
    else:
        # whole documents are fragments too, so calls, delimiters and noise interleave
        text = "".join(draw(st.lists(st.sampled_from(fragments + docs + ["a", "b c"]), max_size=30)))
    cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=24))))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    return name, text, pieces


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_split_text(), st.booleans(), st.booleans())
def test_any_split_yields_the_same_events(case, starts_in_reasoning, truncated):
    name, text, pieces = case
    whole = _events(name, starts_in_reasoning, [text], truncated)
    assert _events(name, starts_in_reasoning, pieces, truncated) == whole


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(sorted(CASES)), st.integers(0, 2), st.booleans())
def test_char_by_char_equals_one_shot_on_documents(name, k, starts_in_reasoning):
    docs = CASES[name][4]
    text = docs[k % len(docs)]
    assert _events(name, starts_in_reasoning, list(text), False) == _events(name, starts_in_reasoning, [text], False)


def test_documents_parse_calls():
    # the well-formed documents really exercise calls (the property is not vacuous)
    for name, (_, _, _, _, docs) in CASES.items():
        events = _events(name, False, [docs[0]], False)
        assert any(type(e).__name__ == "ToolCall" for e in events), name


def test_id_matched_reasoning_delimiter_is_split_independent_around_the_token():
    # with a single-token close, text pieces around the token may be split anyhow
    from tests.output.parsers import THINK_CLOSE

    def run(pieces):
        p = OutputParser(make_reasoning_parser("think", think_syntax(starts_in_reasoning=True)),
                         make_tool_parser("qwen_xml", TOOLS), counter_ids())
        out = []
        for tid, t in pieces:
            out += p.feed(tid, t)
        return coalesce(out + p.finish())

    a = run([(7, "x </thi"), (7, "nk> y"), (THINK_CLOSE, "</think>"), (7, "<function=f><parameter=x>1</function>")])
    b = run([(7, "x </think> y"), (THINK_CLOSE, "</think>"), (7, "<function=f><para"), (7, "meter=x>1</function>")])
    assert a == b


_QWEN_FRAGMENTS = CASES["qwen_xml"][3] + ["a", " b"]


@st.composite
def _token_stream(draw):
    """Text runs between generated delimiter tokens; each run split anyhow, the tokens fixed."""
    from tests.output.parsers import THINK_CLOSE, THINK_OPEN

    runs = draw(st.lists(st.tuples(st.sampled_from([None, THINK_OPEN, THINK_CLOSE]),
                                   st.lists(st.sampled_from(_QWEN_FRAGMENTS), max_size=8).map("".join)),
                         max_size=6))
    whole, split = [], []
    for delim, text in runs:
        if delim is not None:
            token = (delim, "<think>" if delim == THINK_OPEN else "</think>")
            whole.append(token)
            split.append(token)
        if text:
            whole.append((7, text))
            cuts = sorted(set(draw(st.lists(st.integers(0, len(text)), max_size=6))))
            split += [(7, text[i:j]) for i, j in zip([0, *cuts], [*cuts, len(text)]) if j > i]
    return whole, split


@settings(max_examples=400, deadline=None)
@given(_token_stream(), st.booleans(), st.booleans())
def test_id_matched_delimiters_any_split_of_the_text_between(streams, starts_in_reasoning, truncated):
    def run(tokens):
        p = OutputParser(make_reasoning_parser("think", think_syntax(starts_in_reasoning=starts_in_reasoning)),
                         make_tool_parser("qwen_xml", TOOLS), counter_ids())
        out = []
        for tid, t in tokens:
            out += p.feed(tid, t)
        return coalesce(out + p.finish(truncated))

    whole, split = streams
    assert run(split) == run(whole)
