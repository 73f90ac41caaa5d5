"""Kimi K3's native XTML prompt encoder (helios/core/kimi_encoding.py): exact renders of system, user, assistant
(reasoning kept, tool calls) and tool turns and the tool declarations, the always-on thinking with its effort
message, the encoder's checks, its probe (ignition's TemplateCaps), the export that picks it for a tokenizer holding
XTML's control tokens, and the frontend's path (the kimi3 recipe's effort vocabulary into the encoder, the core's
tokenizer keeping each control token one id).

A tiny byte-level tokenizer holds K3's control tokens as specials, in the released order (<|end_of_msg|> first)."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from helios.core.kimi_encoding import (CONTROL_TOKENS, END_OF_MSG, GENERATION_PROMPT, THINKING_EFFORT, EncoderRefusal,
                                       KimiK3Encoding)
from helios.core.manifest import TokenizerInfo
from helios.frontend.chat import ChatMessage, ChatRenderer
from helios.frontend.effort import effort_template_kwargs, native_effort
from helios.frontend.tokenizer import Tokenizer
from ignition.prepare.template import probe_native
from ignition.recipes import resolve

CORPUS = ["message role system user assistant tool think response tools call argument key type string number",
          "The quick brown fox jumps over the lazy dog.", "Weather in Oslo? It is sunny today."] * 4
S, E = "<|sep|>", "<|close|>message<|sep|><|end_of_msg|>"  # a tag's end, a message's end
ENC = KimiK3Encoding()
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
LOOP = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": "ann"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tools", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Oslo", "days": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": {"city": "Roma \"eterna\"", "x": [1, None]}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"}]


def effort(level: str) -> str:
    return '<|open|>message role="system" type="thinking-effort"' + S + THINKING_EFFORT.format(level) + E


def build_kimi_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(CONTROL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


# --- the format ----------------------------------------------------------------------------------------------


def test_an_agent_loop_renders_every_turn_and_keeps_history_reasoning():
    text = ENC.render(LOOP, tools=[TOOL])
    declare = ('<|open|>message role="system" type="tool-declare"' + S + "# Tools\nHere are the available tools, "
               "described in JSONSchema.\n\n```json\n"
               '[{"function":{"description":"Weather.","name":"get_weather","parameters":{"properties":{"city":'
               '{"type":"string"}},"type":"object"}},"type":"function"}]\n```' + E)
    calls = ('<|open|>tools<|sep|><|open|>call tool="get_weather" index="1"<|sep|>'
             '<|open|>argument key="city" type="string"<|sep|>Oslo<|close|>argument<|sep|>'
             '<|open|>argument key="days" type="number"<|sep|>2<|close|>argument<|sep|><|close|>call<|sep|>'
             '<|open|>call tool="get_weather" index="2"<|sep|>'
             '<|open|>argument key="city" type="string"<|sep|>Roma "eterna"<|close|>argument<|sep|>'
             '<|open|>argument key="x" type="array"<|sep|>[1, null]<|close|>argument<|sep|><|close|>call<|sep|>'
             '<|close|>tools<|sep|>')
    assert text == (
        declare + effort("max")
        + '<|open|>message role="system"' + S + "Be brief." + E
        + '<|open|>message role="user" name="ann"' + S + "Hi" + E
        + '<|open|>message role="assistant"' + S + "<|open|>think<|sep|>greet<|close|>think<|sep|>"
        + "<|open|>response<|sep|>Hello!<|close|>response<|sep|>" + E
        + '<|open|>message role="user"' + S + "Weather in Oslo and Rome?" + E
        + '<|open|>message role="assistant"' + S + "<|open|>think<|sep|>need tools<|close|>think<|sep|>"
        + "<|open|>response<|sep|><|close|>response<|sep|>" + calls + E
        + '<|open|>message role="tool" tool="get_weather" index="1"' + S + "sunny" + E
        + '<|open|>message role="tool" tool="get_weather" index="2"' + S + "rain" + E
        + '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_the_published_single_turn_render():
    """Dynamo's pinned `k3_single_turn_think_on` render (system + user at effort max), with encoding_k3.py's think
    opener after the assistant header (Dynamo leaves it to the model; see the encoder's docstring)."""
    text = ENC.render([{"role": "system", "content": "你是一个简洁、准确的助手。"}, {"role": "user", "content": "你好"}])
    assert text == (
        '<|open|>message role="system" type="thinking-effort"<|sep|>'
        "`thinking_effort` guides on how much to think in your thinking channel (not including the response "
        "channel), supported values include `low`, `medium`, `high`, and `max`.\n"
        "Now the system is invoked with `thinking_effort=max`.<|close|>message<|sep|><|end_of_msg|>"
        '<|open|>message role="system"<|sep|>你是一个简洁、准确的助手。<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="user"<|sep|>你好<|close|>message<|sep|><|end_of_msg|>'
        '<|open|>message role="assistant"<|sep|><|open|>think<|sep|>')


def test_thinking_is_always_on_and_effort_is_low_high_or_max():
    user = [{"role": "user", "content": "Hi"}]
    plain = ENC.render(user)
    for off in ({"thinking": False}, {"enable_thinking": False}, {"thinking": "nonsense"}):
        assert ENC.render(user, **off) == plain  # ignored without an error (spec)
    assert plain.startswith(effort("max")) and plain.endswith(GENERATION_PROMPT)
    for level in ("low", "high", "max"):
        assert ENC.render(user, reasoning_effort=level).startswith(effort(level))
    assert ENC.render(user, reasoning_effort="low", thinking_effort="high").startswith(effort("high"))
    for kwargs, param in (({"reasoning_effort": "medium"}, "reasoning_effort"), ({"reasoning_effort": 80},
                          "reasoning_effort"), ({"thinking_effort": "xhigh"}, "chat_template_kwargs")):
        with pytest.raises(EncoderRefusal) as e:
            ENC.render(user, **kwargs)
        assert e.value.param == param


def test_history_calls_results_and_refusals():
    """Arguments that are no JSON object render as the json element; a result takes its call's name by id, else by
    position; an empty whitespace-only reasoning is an empty think channel; no generation prompt on request."""
    turn = {"role": "assistant", "content": "x", "reasoning_content": "  ", "tool_calls": [
        {"id": "a", "function": {"name": "f&g", "arguments": "not json"}}, {"id": "b", "function": {"name": "h"}}]}
    body = ENC.assistant_body(turn)
    assert body == ('<|open|>think<|sep|><|close|>think<|sep|><|open|>response<|sep|>x<|close|>response<|sep|>'
                    '<|open|>tools<|sep|><|open|>call tool="f&amp;g" index="1"<|sep|><|open|>json type="object"<|sep|>'
                    'not json<|close|>json<|sep|><|close|>call<|sep|><|open|>call tool="h" index="2"<|sep|>'
                    '<|close|>call<|sep|><|close|>tools<|sep|>')
    results = ENC.render([turn, {"role": "tool", "tool_call_id": "b", "content": "1"},
                          {"role": "tool", "content": "2"}], add_generation_prompt=False)
    assert '<|open|>message role="tool" tool="h" index="1"<|sep|>1' in results
    assert '<|open|>message role="tool" tool="h" index="2"<|sep|>2' in results and results.endswith(E)
    for messages, kwargs, param in (([], {}, "messages"), ([{"role": "tool", "content": "?"}], {}, "messages"),
                                    ([{"role": "critic", "content": "?"}], {}, "messages"),
                                    ([turn], {"continue_final_message": True}, "continue_final_message"),
                                    (LOOP, {"documents": [{"text": "d"}]}, "messages")):
        with pytest.raises(EncoderRefusal) as e:
            ENC.render(messages, **kwargs)
        assert e.value.param == param


# --- probe, export and the frontend --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok_json() -> str:
    return build_kimi_tokenizer().to_str()


def test_the_probe_records_text_matched_think_channels(tok_json):
    caps = probe_native("kimi_k3", tok_json)
    assert caps.kind == "kimi_k3" and caps.file is None and caps.tools and caps.inline_system and caps.system_role
    assert not caps.continuation and not caps.default_system
    assert caps.generation_prompt == GENERATION_PROMPT and caps.kwargs == ["reasoning_effort", "thinking_effort"]
    r = caps.reasoning
    assert (r.open, r.close, r.open_token_id, r.close_token_id, r.starts_in_reasoning) == (
        "<|open|>think<|sep|>", "<|close|>think<|sep|>", None, None, True)


def test_the_frontend_renders_with_the_recipes_effort_and_single_control_ids(tok_json):
    info = TokenizerInfo(file="tokenizer.json", eos_token_ids=[0])
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tok_json), info, 300)
    renderer, recipe = ChatRenderer(None, probe_native("kimi_k3", tok_json), tokenizer), resolve("kimi3", {})[0]
    kwargs = effort_template_kwargs({}, native_effort("medium", recipe, "reasoning_effort"), recipe)
    assert kwargs == {"reasoning_effort": "high"}  # the neutral level nearest in K3's low/high/max
    prompt = renderer.render([ChatMessage(role="user", content="Hi")], template_kwargs=kwargs)
    assert prompt.text == effort("high") + '<|open|>message role="user"<|sep|>Hi' + E + GENERATION_PROMPT
    ids = {t: tokenizer.encode_with_ends(t)[0] for t in CONTROL_TOKENS}
    assert all(len(v) == 1 for v in ids.values()) and prompt.token_ids[0] == ids["<|open|>"][0]
    assert prompt.token_ids.count(ids[END_OF_MSG][0]) == 2


def test_export_picks_the_encoder_for_a_tokenizer_with_xtml_tokens(tok_json):
    """(The whole export, and the core served: tests/server/test_xtml_served.py.)"""
    from ignition.export import kimi_template_kind

    tok = tokenizers.Tokenizer.from_str(tok_json)
    assert kimi_template_kind(tok, None) == "kimi_k3"
    assert kimi_template_kind(tok, "{{ messages }}") is None  # a Jinja template wins
    assert kimi_template_kind(tokenizers.Tokenizer(models.BPE()), None) is None
