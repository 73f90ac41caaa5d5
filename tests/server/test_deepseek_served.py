"""DeepSeek V4.1's native prompt encoder served for real: the tiny random deepseek_v4 checkpoint (tests/models/
deepseek_v4_tiny.py) with a tokenizer holding DeepSeek's specials and no chat template, exported by ignition under
the deepseek41 recipe (template kind deepseek_v41), `helios serve` on 127.0.0.1 and the official openai SDK. Only
the prompt side and the error shapes are checked (the model is random): the effort hint in the prompt the engine
received (return_token_ids), the spec's 400s for a float effort, add_generation_prompt=false, drop_thinking and
an assistant continuation, and System One's label check on the native prompt."""

from __future__ import annotations

import json

import httpx
import pytest

from helios.core.deepseek_encoding import ASSISTANT, EOS, SYSTEM, USER, native_encoder
from helios.core.load import read_manifest
from helios.frontend.tokenizer import Tokenizer
from helios.output.events import ParseError, TextDelta, ToolCall
from helios.output.parsers import build
from tests.frontend.test_deepseek_encoders import write_deepseek_tokenizer
from tests.models.deepseek_v4_tiny import build_deepseek_v4
from tests.server.conftest import _stop, serve_core

EFFORT_80 = SYSTEM + "Reasoning Effort: 80 (range 1-100, the higher the value, the more thorough the reasoning)"
USER_HI = [{"role": "user", "content": "Hi"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "when": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """The tiny deepseek_v4 checkpoint exported under deepseek41: the core's path."""
    from ignition.export import ExportOptions, export_core

    tmp = tmp_path_factory.mktemp("deepseek41")
    src = build_deepseek_v4(tmp / "hf")
    write_deepseek_tokenizer(src)
    return export_core(src, tmp / "core", ExportOptions(dtype="float32", recipe="deepseek41"))


@pytest.fixture(scope="module")
def served(core, tmp_path_factory):
    """(openai client, url, the core's tokenizer)."""
    import openai

    tmp = tmp_path_factory.mktemp("deepseek41_serve")
    manifest = read_manifest(core)
    assert manifest.template.kind == "deepseek_v41" and not (core / "template.jinja").exists()
    assert manifest.recipe.tool_parser == "dsml_v41"  # the spelling the V4.1 encoder teaches
    tokenizer = Tokenizer.from_file(core / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    config = tmp / "server.toml"
    config.write_text("[server]\n", encoding="utf-8")
    proc, url = serve_core(core, config, tmp / "serve.log", timeout_s=120, poll_s=0.2)
    try:
        with openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as client:
            yield client, url, tokenizer
    finally:
        _stop(proc)


def _prompt(served, **extra) -> str:
    client, _, tokenizer = served
    r = client.chat.completions.create(model="m", messages=USER_HI, max_tokens=1,
                                       extra_body={"return_token_ids": True, **extra})
    return tokenizer.decode(r.model_extra["prompt_token_ids"])


def test_a_numeric_effort_renders_the_v41_hint(served):
    """(The other spellings and the default: tests/frontend/test_deepseek_encoders.py.)"""
    prompt = _prompt(served, reasoning_effort=80)
    assert prompt.startswith("<｜begin▁of▁sentence｜>" + EFFORT_80) and prompt.endswith(USER + "Hi" + ASSISTANT
                                                                                         + "<think>")
    off = _prompt(served, reasoning_effort=80, chat_template_kwargs={"thinking": False})
    assert "Reasoning Effort" not in off and off.endswith(ASSISTANT + "</think>")


@pytest.mark.parametrize("extra,param", [
    ({"reasoning_effort": 80.0}, "reasoning_effort"),
    ({"chat_template_kwargs": {"reasoning_effort": "80"}}, "chat_template_kwargs"),
    ({"add_generation_prompt": False}, "add_generation_prompt"),
    ({"chat_template_kwargs": {"drop_thinking": True}}, "chat_template_kwargs"),
])
def test_the_spec_refusals_are_openai_400s(served, extra, param):
    import openai

    client = served[0]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=USER_HI, max_tokens=1, extra_body=extra)
    assert e.value.status_code == 400
    assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param


def test_an_assistant_continuation_is_refused(served):
    import openai

    client = served[0]
    prefill = [*USER_HI, {"role": "assistant", "content": "The answer is"}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="m", messages=prefill, max_tokens=1)
    assert "final assistant message" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=prefill, max_tokens=1,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})


def test_system_one_verifies_its_labels_on_the_native_prompt(served):
    """The scorer renders with thinking off (the encoder's kwargs) and finds single-token labels after
    <｜Assistant｜></think>."""
    body = {"model": "m", "state": {"message": "Charged twice"},
            "questions": {"team": {"type": "choice", "criteria": {"billing": None, "support": "Other help"}}}}
    r = httpx.post(served[1] + "/v1/systemone", json=body, timeout=60)
    assert r.status_code == 200, r.text
    answer = r.json()["answers"]["team"]
    assert answer["choice"] in ("billing", "support") and r.json()["usage"]["output_tokens"] == 1


def test_a_history_tool_call_renders_in_v41_tags_and_the_cores_parser_reads_it_back(core, served):
    """The served frontend renders a history call with V4.1's spaced DSML tags (the prompt the engine got); that
    assistant turn, fed as generated text to the parser the core records, is the same call again. (No tools are
    declared: the tool block alone outgrows the tiny core's 512-token context; history calls render the same.)"""
    client, _, tokenizer = served
    manifest = read_manifest(core)
    args = {"city": "Oslo", "days": 2, "when": "today"}
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(args)}}
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [
        call]}, {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    r = client.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                       extra_body={"return_token_ids": True})
    prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
    start = prompt.index(ASSISTANT + "</think>") + len(ASSISTANT + "</think>")  # history reasoning dropped
    reply = prompt[start:prompt.index(EOS, start)]  # the history turn as the model generated it, thinking off
    assert reply == "\n\n" + native_encoder("deepseek_v41").calls_block([call])
    assert '<｜DSML｜ calls>\n<｜DSML｜ invoke name="get_weather">\n<｜DSML｜ parameter name="city" string="true">Oslo' \
        '</｜DSML｜ parameter>' in reply
    parser = build(manifest.recipe.tool_parser, manifest.recipe.reasoning_parser, None, [WEATHER])
    events = [e for ch in reply for e in parser.feed(7, ch)] + parser.finish(False)
    calls = [(e.name, json.loads(e.arguments)) for e in events if isinstance(e, ToolCall)]
    assert calls == [("get_weather", args)] and not [e for e in events if isinstance(e, ParseError)]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "\n\n"
