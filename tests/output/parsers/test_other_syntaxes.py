"""GLM, Hermes, Gemma 4, MiniMax, DeepSeek DSML, Kimi and Step tool syntaxes from token streams."""

from __future__ import annotations

from tests.output.parsers import parser, run, texts, tool

from helios.output.events import ToolCallStart

TOOLS = [tool("get_weather", city="string", days="integer"), tool("calc", x="number", flags="array")]


def _tokens(text: str, size: int = 4) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


# -- GLM ------------------------------------------------------------------------------------------------
def test_glm_call_with_schema_conversion():
    text = ("Checking.<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Beijing</arg_value>\n"
            "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    p = parser("glm", tools=TOOLS)
    assert texts(run(p, _tokens(text))) == [("text", "Checking."),
                                            ("call", "get_weather", {"city": "Beijing", "days": 2})]


def test_glm_start_rule_and_no_argument_call():
    p = parser("glm", tools=TOOLS)
    text = "GLM wraps calls in <tool_call> tags and <tool_call>name here too."
    assert texts(run(p, _tokens(text))) == [("text", text)]
    p = parser("glm", tools=TOOLS)
    assert texts(run(p, ["<tool_call>now</tool_call>"])) == [("call", "now", {})]


def test_glm_call_in_reasoning_ends_it():
    from tests.output.parsers import think_syntax

    p = parser("glm", "glm", think_syntax(starts_in_reasoning=True), TOOLS)
    events = run(p, _tokens("hmm <tool_call>calc<arg_key>x</arg_key><arg_value>1.5</arg_value></tool_call>ok"))
    assert texts(events) == [("reasoning", "hmm "), ("call", "calc", {"x": 1.5}), ("text", "ok")]


# -- Hermes ---------------------------------------------------------------------------------------------
def test_hermes_json_calls():
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>\n'
            '<tool_call>\n{"name": "calc", "arguments": "{\\"x\\": 2}"}\n</tool_call>')
    p = parser("hermes", tools=TOOLS)
    assert texts(run(p, _tokens(text, 5))) == [("call", "get_weather", {"city": "Paris", "days": 3}),
                                               ("text", "\n"), ("call", "calc", {"x": 2})]


def test_hermes_quoted_tag_text_and_malformed_json_error():
    p = parser("hermes", tools=TOOLS)
    assert texts(run(p, ["Use <tool_call> tags."])) == [("text", "Use <tool_call> tags.")]
    p = parser("hermes", tools=TOOLS)
    assert texts(run(p, ['<tool_call>{"name": "calc", "arguments": {x}}</tool_call>'])) == [
        ("error", "invalid_call")]
    p = parser("hermes", tools=TOOLS)
    assert texts(run(p, ['<tool_call>{"name": "", "arguments": {}}</tool_call>'])) == [("error", "invalid_call")]


# -- Gemma 4 --------------------------------------------------------------------------------------------
def test_gemma4_call_syntax():
    text = ('<|tool_call>call:get_weather{city:<|"|>Paris, "FR"<|"|>,days:3,opts:{metric:true,note:null},'
            'tags:[<|"|>a<|"|>,2.5,x]}<tool_call|>Done')
    p = parser("gemma4", tools=TOOLS)
    assert texts(run(p, _tokens(text, 3))) == [
        ("call", "get_weather", {"city": 'Paris, "FR"', "days": 3, "opts": {"metric": True, "note": None},
                                 "tags": ["a", 2.5, "x"]}),
        ("text", "Done")]


def test_gemma4_opener_always_starts_a_call():
    p = parser("gemma4", tools=TOOLS)
    events = run(p, ["Note the <|tool_call> token."])
    assert texts(events) == [("text", "Note the "), ("error", "incomplete_call")]
    p = parser("gemma4", tools=TOOLS)
    assert texts(run(p, ["<|tool_call>call:calc{x:1<tool_call|>"])) == [("error", "invalid_call")]


# -- MiniMax --------------------------------------------------------------------------------------------
def test_minimax_section_with_two_invokes():
    text = ('I will check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris'
            '</parameter>\n<parameter name="days">4</parameter>\n</invoke>\n<invoke name="calc">\n'
            '<parameter name="flags">["a"]</parameter>\n</invoke>\n</minimax:tool_call>')
    p = parser("minimax", tools=TOOLS)
    events = run(p, _tokens(text))
    assert texts(events) == [("text", "I will check.\n"), ("call", "get_weather", {"city": "Paris", "days": 4}),
                             ("call", "calc", {"flags": ["a"]})]
    assert [e.index for e in events if isinstance(e, ToolCallStart)] == [0, 1]


def test_minimax_opener_always_starts():
    p = parser("minimax", tools=TOOLS)
    assert texts(run(p, ["the <minimax:tool_call> opener", "<invoke name=\"calc\">"])) == [
        ("text", "the "), ("error", "incomplete_call")]


# -- DeepSeek DSML --------------------------------------------------------------------------------------
B = "\uff5c"


def test_dsml_calls_string_attribute_and_discard_after_close():
    text = (f'Sure.\n\n<{B}DSML{B}function_calls>\n<{B}DSML{B}invoke name="get_weather">\n'
            f'<{B}DSML{B}parameter name="city" string="true">  Paris </{B}DSML{B}parameter>\n'
            f'<{B}DSML{B}parameter name="days" string="false">5</{B}DSML{B}parameter>\n</{B}DSML{B}invoke>\n'
            f'<{B}DSML{B}invoke name="calc">\n<{B}DSML{B}parameter name="flags" string="false">[1, "b"]'
            f'</{B}DSML{B}parameter>\n</{B}DSML{B}invoke>\n</{B}DSML{B}function_calls>trailing text dropped')
    p = parser("dsml", "dsml", tools=TOOLS)
    assert texts(run(p, _tokens(text, 3))) == [("text", "Sure.\n\n"),
                                               ("call", "get_weather", {"city": "  Paris ", "days": 5}),
                                               ("call", "calc", {"flags": [1, "b"]})]


def test_dsml_reasoning_then_call_and_validation():
    inv = (f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="calc"><{B}DSML{B}parameter name="x" string="false">'
           f'2</{B}DSML{B}parameter><{B}DSML{B}parameter name="x" string="false">3</{B}DSML{B}parameter>'
           f'</{B}DSML{B}invoke></{B}DSML{B}function_calls>')
    p = parser("dsml", "dsml", tools=TOOLS)
    events = run(p, _tokens("<think>plan</think>" + inv))
    assert texts(events) == [("reasoning", "plan"), ("error", "invalid_call")]  # duplicate argument name
    p = parser("dsml", "dsml", tools=TOOLS)
    empty = f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name=""></{B}DSML{B}invoke>'
    assert texts(run(p, [empty])) == [("error", "invalid_call")]


def test_dsml_each_call_published_when_its_invoke_closes():
    p = parser("dsml", "dsml", tools=TOOLS)
    head = f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="calc"></{B}DSML{B}invoke>'
    events = p.feed(7, head)
    assert texts(events) == [("call", "calc", {})]  # before the section closes
    assert texts(p.finish(truncated=True)) == []


# -- Kimi, Step -----------------------------------------------------------------------------------------
def test_kimi_section():
    text = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_call_begin|>functions.calc:1<|tool_call_argument_begin|>'
            '{"x": 1}<|tool_call_end|><|tool_calls_section_end|>')
    p = parser("kimi", tools=TOOLS)
    assert texts(run(p, _tokens(text, 6))) == [("call", "get_weather", {"city": "Paris"}), ("call", "calc", {"x": 1})]


def test_step_section():
    text = ('Let me see.<|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|><steptml:invoke name="calc">'
            '<steptml:parameter name="x">4</steptml:parameter></steptml:invoke><|tool_call_end|><|tool_calls_end|>')
    p = parser("step", tools=TOOLS)
    assert texts(run(p, _tokens(text, 5))) == [("text", "Let me see."), ("call", "calc", {"x": 4})]


def test_dsml_text_after_the_section_is_discarded_even_reasoning_tags():
    p = parser("dsml", "dsml", tools=TOOLS)
    section = (f'<{B}DSML{B}function_calls><{B}DSML{B}invoke name="calc"></{B}DSML{B}invoke>'
               f'</{B}DSML{B}function_calls>')
    assert texts(run(p, [section, "<think>more</think>", "words"])) == [("call", "calc", {})]
