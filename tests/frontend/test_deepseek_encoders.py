"""The native DeepSeek V4 / V4.1 prompt encoders (helios/core/deepseek_encoding.py): exact rendering of system, user,
assistant and tool turns as DeepSeek's encoding scripts write them, history reasoning dropped before the last user
turn (kept while tools are declared), the effort prefixes, the encoders' own checks, their probe (ignition's
TemplateCaps) and the frontend's path: the recipe's effort rules into the encoder, the request refusals as
InvalidRequest naming the field, a later system message on V4 as a <system> user turn.

A tiny byte-level tokenizer holds DeepSeek's specials as added tokens, so delimiters are single ids as in the
released tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from helios.core.chat_template import TemplateError
from helios.core.deepseek_encoding import (ASSISTANT, BOS, EOS, SYSTEM, USER, V4_EFFORT_PREFIXES, EncoderRefusal,
                                           native_encoder)
from helios.core.manifest import TokenizerInfo
from helios.frontend.chat import ChatMessage, ChatRenderer
from helios.frontend.effort import effort_template_kwargs, native_effort
from helios.frontend.sampling import InvalidRequest
from helios.frontend.tokenizer import Tokenizer
from ignition.prepare.template import probe_native
from ignition.recipes import resolve

# DeepSeek's specials first: ids 0 (BOS) and 2 (EOS) as tests/ignition/tiny_models' BOS_ID / EOS_ID
SPECIALS = [BOS, USER, EOS, ASSISTANT, SYSTEM, "<think>", "</think>"]
CORPUS = ["The quick brown fox jumps over the lazy dog.", "Weather in Oslo? It is sunny today.",
          "Reasoning Effort: 80 (range 1-100)", "Be brief. Hello!"] * 4
HIGH, MAX = V4_EFFORT_PREFIXES["high"], V4_EFFORT_PREFIXES["max"]
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOLS_V4 = '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">Oslo' \
           '</｜DSML｜parameter>\n<｜DSML｜parameter name="days" string="false">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n' \
           '</｜DSML｜tool_calls>'
TOOLS_V41 = TOOLS_V4.replace("｜DSML｜tool_calls", "｜DSML｜ calls").replace("｜DSML｜invoke", "｜DSML｜ invoke") \
    .replace("｜DSML｜parameter", "｜DSML｜ parameter")
# an agent loop: a first exchange, then a question answered through a tool call
LOOP = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "reasoning_content": "need tool", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo", '
                                                                                               '"days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def build_deepseek_tokenizer() -> tokenizers.Tokenizer:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def write_deepseek_tokenizer(out_dir: Path) -> None:
    """tokenizer.json and a tokenizer_config.json without a chat template, as DeepSeek V4 releases ship them."""
    (out_dir / "tokenizer.json").write_text(build_deepseek_tokenizer().to_str(), encoding="utf-8")
    config = {"add_bos_token": False, "add_eos_token": False, "bos_token": BOS, "eos_token": EOS,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")


@pytest.fixture(scope="module")
def tok_json() -> str:
    return build_deepseek_tokenizer().to_str()


@pytest.fixture(scope="module")
def renderers(tok_json):
    """kind -> (ChatRenderer over the probed caps, the recipe)."""
    info = TokenizerInfo(file="tokenizer.json", bos_token_id=0, eos_token_ids=[2])
    tokenizer = Tokenizer(tokenizers.Tokenizer.from_str(tok_json), info, 300)
    out = {}
    for kind, recipe in (("deepseek_v4", "deepseek4"), ("deepseek_v41", "deepseek41")):
        out[kind] = ChatRenderer(None, probe_native(kind, tok_json), tokenizer), resolve(recipe, {})[0]
    return out


# --- the formats ---------------------------------------------------------------------------------------------


def test_v4_renders_an_agent_loop_and_drops_history_reasoning():
    text = native_encoder("deepseek_v4").render(LOOP)
    assert text == (BOS + HIGH + "Be brief." + USER + "Hi" + ASSISTANT + "</think>Hello!" + EOS
                    + USER + "Weather in Oslo?" + ASSISTANT + "</think>\n\n" + TOOLS_V4 + EOS
                    + USER + "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>")


def test_v4_with_tools_keeps_history_reasoning_and_shows_the_tool_block():
    encoder = native_encoder("deepseek_v4")
    text = encoder.render(LOOP, tools=[TOOL], reasoning_effort="low")
    block = encoder.tools_block([TOOL])
    assert block.startswith('## Tools\n\nYou have access to a set of tools to help answer the user\'s question. You '
                            'can invoke tools by writing a "<｜DSML｜tool_calls>" block like the following:\n\n')
    assert '\n\n### Available Tool Schemas\n\n{"name": "get_weather", "description": "Weather.", "parameters": ' \
           '{"type": "object", "properties": {"city": {"type": "string"}}}}\n\nYou MUST strictly follow' in block
    assert text == (BOS + "Be brief.\n\n" + block + USER + "Hi" + ASSISTANT + "<think>greet</think>Hello!" + EOS
                    + USER + "Weather in Oslo?" + ASSISTANT + "<think>need tool</think>\n\n" + TOOLS_V4 + EOS
                    + USER + "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>")
    # without a system message the tools lead in an empty one
    alone = encoder.render([{"role": "user", "content": "Hi"}], tools=[TOOL], thinking=False)
    assert alone == BOS + "\n\n" + block + USER + "Hi" + ASSISTANT + "</think>"


def test_v41_system_token_numeric_effort_spaced_dsml_and_inline_system():
    encoder = native_encoder("deepseek_v41")
    effort = "Reasoning Effort: 80 (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
    assert encoder.render(LOOP, reasoning_effort=80) == (
        BOS + SYSTEM + effort + "Be brief." + USER + "Hi" + ASSISTANT + "</think>Hello!" + EOS
        + USER + "Weather in Oslo?" + ASSISTANT + "</think>\n\n" + TOOLS_V41 + EOS
        + USER + "<tool_result>sunny</tool_result>" + ASSISTANT + "<think>")
    assert '"<｜DSML｜ calls>" block' in encoder.tools_block([TOOL])
    # a later system message has its token and opens the reply; the effort prefix alone still takes the token
    later = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
             {"role": "system", "content": "Now in French."}]
    assert encoder.render(later, thinking=False) == (BOS + USER + "Hi" + ASSISTANT + "</think>Hello!" + EOS + SYSTEM
                                                     + "Now in French." + ASSISTANT + "</think>")
    assert encoder.render(later[:1]).startswith(BOS + SYSTEM + effort.replace("80", "75") + USER + "Hi")


@pytest.mark.parametrize("kind,effort,prefix", [
    ("deepseek_v4", None, HIGH), ("deepseek_v4", "low", ""), ("deepseek_v4", "high", HIGH),
    ("deepseek_v4", "xhigh", MAX), ("deepseek_v4", "max", MAX),
    ("deepseek_v41", None, "75"), ("deepseek_v41", "low", "50"), ("deepseek_v41", "xhigh", "75"),
    ("deepseek_v41", "max", "100"), ("deepseek_v41", 1, "1"),
])
def test_effort_prefixes_and_thinking_off_suppresses_them(kind, effort, prefix):
    encoder, user = native_encoder(kind), [{"role": "user", "content": "Hi"}]
    text = encoder.render(user, reasoning_effort=effort)
    lead = text[len(BOS):text.index(USER)]
    assert lead == (prefix if kind == "deepseek_v4" else f"{SYSTEM}Reasoning Effort: {prefix} (range 1-100, the "
                    "higher the value, the more thorough the reasoning)\n\n")
    for off in ({"thinking": False}, {"enable_thinking": False}):
        assert encoder.render(user, reasoning_effort=effort, **off) == BOS + USER + "Hi" + ASSISTANT + "</think>"


@pytest.mark.parametrize("kind,kwargs,param", [
    ("deepseek_v4", {"reasoning_effort": 80}, "reasoning_effort"),
    ("deepseek_v4", {"reasoning_effort": "medium"}, "reasoning_effort"),
    ("deepseek_v41", {"reasoning_effort": 80.0}, "reasoning_effort"),
    ("deepseek_v41", {"reasoning_effort": True}, "reasoning_effort"),
    ("deepseek_v41", {"reasoning_effort": "80"}, "reasoning_effort"),
    ("deepseek_v41", {"reasoning_effort": 101}, "reasoning_effort"),
    ("deepseek_v41", {"reasoning_effort": 0, "thinking": False}, "reasoning_effort"),
    ("deepseek_v4", {"drop_thinking": True}, "chat_template_kwargs"),
    ("deepseek_v41", {"drop_thinking": False}, "chat_template_kwargs"),
    ("deepseek_v4", {"thinking": "yes"}, "chat_template_kwargs"),
    ("deepseek_v41", {"thinking": True, "enable_thinking": False}, "chat_template_kwargs"),
    ("deepseek_v4", {"continue_final_message": True}, "continue_final_message"),
])
def test_the_encoders_refuse(kind, kwargs, param):
    with pytest.raises(EncoderRefusal) as e:
        native_encoder(kind).render([{"role": "user", "content": "Hi"}], **kwargs)
    assert e.value.param == param


def test_the_encoders_refuse_conversations_they_cannot_render():
    v4, v41 = native_encoder("deepseek_v4"), native_encoder("deepseek_v41")
    prefill = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The answer is"}]
    for encoder in (v4, v41):
        with pytest.raises(TemplateError, match="final assistant"):
            encoder.render(prefill)
    bad_call = [*LOOP[:4], {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "not json"}}]},
        {"role": "tool", "content": "x"}]
    assert '<｜DSML｜parameter name="arguments" string="true">not json</｜DSML｜parameter>' in v4.render(bad_call)
    with pytest.raises(TemplateError, match="JSON object"):
        v41.render(bad_call)
    with pytest.raises(TemplateError, match="after the first"):  # V4 has no marker for it (the probe's finding)
        v4.render([LOOP[1], {"role": "system", "content": "x"}, LOOP[3]])


# --- the probe and the frontend ------------------------------------------------------------------------------


def test_the_probe_describes_the_encoders(tok_json):
    tok = build_deepseek_tokenizer()
    for kind in ("deepseek_v4", "deepseek_v41"):
        caps = probe_native(kind, tok_json)
        assert caps.present and caps.kind == kind and caps.file is None
        assert caps.generation_prompt == ASSISTANT + "<think>" and caps.tools and caps.system_role
        assert not caps.continuation and not caps.default_system
        assert caps.inline_system == (kind == "deepseek_v41")
        assert caps.kwargs == ["enable_thinking", "reasoning_effort", "thinking"]
        r = caps.reasoning
        assert (r.open, r.close, r.starts_in_reasoning) == ("<think>", "</think>", True)
        assert (r.open_token_id, r.close_token_id) == (tok.token_to_id("<think>"), tok.token_to_id("</think>"))


def _render(renderers, kind, messages=None, **options):
    renderer, recipe = renderers[kind]
    kwargs = options.pop("template_kwargs", None)
    effort = native_effort(options.pop("reasoning_effort", None), recipe, "reasoning_effort")
    kwargs = effort_template_kwargs(kwargs, effort, recipe)
    return renderer.render(messages or [ChatMessage(role="user", content="Hi")], template_kwargs=kwargs, **options)


def test_the_frontend_resolves_effort_through_the_recipe(renderers):
    """V4.1: a JSON integer 1..100 at the top level or in chat_template_kwargs, named levels as the spec's
    scores, null as the high default; V4 takes named levels only."""
    def effort(**options):
        text = _render(renderers, "deepseek_v41", **options).text
        return text.split("Reasoning Effort: ")[1].split(" ")[0]

    assert effort(reasoning_effort=80) == "80"
    assert effort(template_kwargs={"reasoning_effort": 80}) == "80"
    assert effort(reasoning_effort=None) == effort(template_kwargs={"reasoning_effort": None}) == "75"
    assert effort(reasoning_effort="low") == "50" and effort(reasoning_effort="max") == "100"
    assert effort(reasoning_effort="medium") == "75"  # the neutral level nearest the vocabulary: high
    for bad in (80.0, True, "80", 0, 101):
        with pytest.raises(InvalidRequest) as e:
            _render(renderers, "deepseek_v41", reasoning_effort=bad)
        assert e.value.param == "reasoning_effort"
    with pytest.raises(InvalidRequest):
        _render(renderers, "deepseek_v4", reasoning_effort=80)
    assert _render(renderers, "deepseek_v4", reasoning_effort="max").text == BOS + MAX + USER + "Hi" + ASSISTANT \
        + "<think>"
    prompt = _render(renderers, "deepseek_v4", template_kwargs={"thinking": False})
    assert prompt.text == BOS + USER + "Hi" + ASSISTANT + "</think>"
    assert prompt.token_ids[-2:] == [SPECIALS.index(ASSISTANT), SPECIALS.index("</think>")]


@pytest.mark.parametrize("options,param", [
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"template_kwargs": {"drop_thinking": True}}, "chat_template_kwargs"),
    ({"add_generation_prompt": False, "continue_final_message": True}, "add_generation_prompt"),
    ({"continue_final_message": True}, "continue_final_message"),
    ({}, "messages"),  # a final assistant message: no continuation
])
def test_the_frontend_refuses_requests_by_field(renderers, options, param):
    for kind in ("deepseek_v4", "deepseek_v41"):
        with pytest.raises(InvalidRequest) as e:
            _render(renderers, kind, [ChatMessage(role="user", content="Hi"),
                                      ChatMessage(role="assistant", content="The")], **options)
        assert e.value.param == param


def test_a_later_system_message_is_a_system_user_turn_on_v4_and_inline_on_v41(renderers):
    messages = [ChatMessage(role="user", content="Hi"), ChatMessage(role="assistant", content="Hello!"),
                ChatMessage(role="system", content="Now in French."), ChatMessage(role="user", content="Bye")]
    off = {"template_kwargs": {"thinking": False}}
    v4 = _render(renderers, "deepseek_v4", messages, **off).text
    assert v4.endswith(EOS + USER + "<system>Now in French.</system>\n\nBye" + ASSISTANT + "</think>")
    v41 = _render(renderers, "deepseek_v41", messages, **off).text
    assert v41.endswith(EOS + SYSTEM + "Now in French." + USER + "Bye" + ASSISTANT + "</think>")


def test_which_checkpoints_export_a_native_encoder():
    """deepseek_v4 under a DeepSeek recipe (its default) or without a template; a Jinja template otherwise."""
    from ignition.export import native_template_kind

    assert native_template_kind("deepseek_v4", "deepseek41", "{{ messages }}") == "deepseek_v41"
    assert native_template_kind("deepseek_v4", "deepseek4", None) == "deepseek_v4"
    assert native_template_kind("deepseek_v4", "default", None) == "deepseek_v4"
    assert native_template_kind("deepseek_v4", "default", "{{ messages }}") is None
    assert native_template_kind("qwen3", "deepseek41", None) is None  # a recipe alone binds no encoder
