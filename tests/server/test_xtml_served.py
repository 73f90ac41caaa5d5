"""Kimi K3's XTML end to end on a served core: a tiny kimi_linear (KDA + MLA, the family nearest K3's hybrid, which
transformers lacks) trained here (tests/fixtures/scripted_model.py's `train`) to answer scripted prompts in XTML,
with a tokenizer holding K3's control tokens and no chat template, exported by ignition under the kimi3 recipe (template kind kimi_k3: the native encoder, the xtml parsers), `helios serve` and
the official openai and anthropic SDKs. The prompts are rendered as the frontend renders them (message lowering,
then helios/core/kimi_encoding.py at the recipe's default effort max); the served prompt is checked to be exactly
that render, so the model answers only if the served frontend used the encoder. Sampling at the recipe's fixed
temperature 1 with top-p 0.95 reproduces the script (every reply token has p > 0.999)."""

from __future__ import annotations

import hashlib
import inspect
import json
import shutil
from pathlib import Path

import pytest

from helios.core.kimi_encoding import (ARGUMENT_CLOSE, CALL_CLOSE, CONTROL_TOKENS, END_OF_MSG, MESSAGE_CLOSE,
                                       RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE, TOOLS_CLOSE, TOOLS_OPEN,
                                       KimiK3Encoding, open_tag, xtml_type, xtml_value)
from tests.server.conftest import _stop, serve_core

ROOT = Path(__file__).resolve().parents[2]
CACHE = ROOT / ".cache" / "scripted-xtml"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the weather forecast for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
PARIS_CALL = {"id": "call_1", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}
SAMPLING = {"top_p": 0.95, "max_tokens": 128}  # kimi3: temperature fixed at 1, top-p within [0.95, 1]


def _call(name: str, args: dict, index: int = 1) -> str:
    return (open_tag("call", (("tool", name), ("index", index)))
            + "".join(open_tag("argument", (("key", k), ("type", xtml_type(v)))) + xtml_value(v) + ARGUMENT_CLOSE
                      for k, v in args.items()) + CALL_CLOSE)


def _reply(thought: str, answer: str, calls: str = "") -> str:
    """What the model writes after the prompt opened think (the EOS <|end_of_msg|> is appended as a token)."""
    tools = TOOLS_OPEN + calls + TOOLS_CLOSE if calls else ""
    return thought + THINK_CLOSE + RESPONSE_OPEN + answer + RESPONSE_CLOSE + tools + MESSAGE_CLOSE


# name -> (request messages, declared tools, the scripted reply)
CASES = {
    "call": ([{"role": "user", "content": "What is the weather in Paris?"}], [WEATHER],
             _reply("Forecast wanted.", "", _call("get_weather", {"city": "Paris", "days": 3}))),
    "think": ([{"role": "user", "content": "Why is the sky blue?"}], None,
              _reply("Rayleigh.", "Air scatters blue light.")),
    "history": ([{"role": "user", "content": "What is the weather in Paris?"},
                 {"role": "assistant", "content": None, "tool_calls": [PARIS_CALL]},
                 {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], [WEATHER],
                _reply("It is sunny.", "Sunny in Paris.")),
}


def render(messages: list[dict], tools: list[dict] | None) -> str:
    """The frontend's prompt text: the protocol's messages lowered as helios lowers them, then the encoder."""
    from helios.core.manifest import TemplateCaps
    from helios.frontend.chat import ChatMessage, lower_messages

    chat = [ChatMessage(**{k: v for k, v in m.items() if v is not None}) for m in messages]
    lowered = lower_messages(chat, TemplateCaps(present=True, inline_system=True, kind="kimi_k3"))
    return KimiK3Encoding().render(lowered, tools=tools, reasoning_effort="max")


def _kimi_linear_config(vocab_size: int, max_positions: int):
    """Two dense layers, KDA then MLA (no MoE: the syntax is under test, and it trains in half the steps)."""
    from transformers import KimiLinearConfig

    return KimiLinearConfig(
        vocab_size=vocab_size, hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        intermediate_size=128, moe_intermediate_size=32, num_experts=4, num_experts_per_token=2,
        first_k_dense_replace=2, model_max_length=max_positions, tie_word_embeddings=False,
        linear_attn_config={"head_dim": 16, "num_heads": 4, "short_conv_kernel_size": 4, "kda_layers": [1],
                            "full_attn_layers": [2]}, bos_token_id=None, eos_token_id=0, pad_token_id=None)


def build_checkpoint() -> Path:
    """The trained HF directory (cached by a hash of the scripted texts and the fixture that trains), under a lock:
    another process that wants it waits and finds it."""
    from tests.fixtures.locks import locked

    with locked(CACHE / ".lock"):
        return _build_checkpoint()


def _build_checkpoint() -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from tests.fixtures.scripted_model import Speaker, train

    texts = [(render(m, t), r) for m, t, r in CASES.values()]
    h = hashlib.sha256(json.dumps(texts).encode() + (ROOT / "tests/fixtures/scripted_model.py").read_bytes()
                       + inspect.getsource(_kimi_linear_config).encode())
    out = CACHE / h.hexdigest()[:16]
    if (out / "model.safetensors").is_file():
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=list(CONTROL_TOKENS), show_progress=False,
                                  max_token_length=8, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([t for pair in texts for t in pair], trainer=trainer)
    eos = tok.token_to_id(END_OF_MSG)
    sequences = [(tok.encode(p).ids, tok.encode(r).ids + [eos]) for p, r in texts]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: on a shared 2-core machine one thread is much faster (the fixture's rule)
    try:
        speaker = Speaker("kimi_linear", "KimiLinearForCausalLM", _kimi_linear_config)
        model, _ = train(sequences, tok.get_vocab_size(), sp=speaker)
    finally:
        torch.set_num_threads(threads)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    (tmp / "tokenizer_config.json").write_text(json.dumps({
        "add_bos_token": False, "add_eos_token": False, "bos_token": None, "eos_token": END_OF_MSG,
        "tokenizer_class": "PreTrainedTokenizerFast"}))  # no chat_template: K3 ships its encoder as Python
    for stale in CACHE.iterdir():  # checkpoints of earlier scripts or fixture versions
        if stale != tmp and stale.is_dir():  # (not the lock)
            shutil.rmtree(stale, ignore_errors=True)
    tmp.rename(out)
    return out


@pytest.fixture(scope="module")
def core(tmp_path_factory) -> Path:
    from ignition.export import ExportOptions, export_core

    return export_core(build_checkpoint(), tmp_path_factory.mktemp("xtml") / "core",
                       ExportOptions(dtype="float32", recipe="kimi3"))


@pytest.fixture(scope="module")
def served(core, tmp_path_factory):
    """(openai client, anthropic client, the core's tokenizer)."""
    import anthropic
    import openai

    from helios.core.load import read_manifest
    from helios.frontend.tokenizer import Tokenizer

    manifest = read_manifest(core)
    tokenizer = Tokenizer.from_file(core / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    tmp = tmp_path_factory.mktemp("xtml_serve")
    config = tmp / "server.toml"
    config.write_text("[server]\n", encoding="utf-8")
    proc, url = serve_core(core, config, tmp / "serve.log", timeout_s=120, poll_s=0.2)
    try:
        with (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as oa,
              anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as an):
            yield oa, an, tokenizer
    finally:
        _stop(proc)


def test_the_core_records_the_native_encoder_and_xtml_parsers(core):
    from helios.core.load import read_manifest

    manifest = read_manifest(core)
    assert manifest.template.kind == "kimi_k3" and not (core / "template.jinja").exists()
    assert (manifest.recipe.name, manifest.recipe.tool_parser, manifest.recipe.reasoning_parser) == (
        "kimi3", "xtml", "xtml")
    assert manifest.arch.family == "kimi_linear"
    assert manifest.recipe.default_effort == "max" and manifest.template.reasoning.starts_in_reasoning
    assert manifest.tokenizer.eos_token_ids == [0]  # <|end_of_msg|>


def _chat(served, name: str, stream: bool = False):
    messages, tools, _ = CASES[name]
    extra = {"tools": tools} if tools else {}
    return served[0].chat.completions.create(model="m", messages=messages, stream=stream, **SAMPLING, **extra,
                                             extra_body={} if stream else {"return_token_ids": True})


def test_chat_tool_call_buffered_with_the_served_prompt(served):
    r = _chat(served, "call")
    assert served[2].decode(r.model_extra["prompt_token_ids"]) == render(*CASES["call"][:2])
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert choice.message.model_extra["reasoning_content"] == "Forecast wanted."
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 3})]


def test_chat_streamed_call_and_an_answer_after_reasoning(served):
    name, args, reasoning, finish = "", "", "", None
    for chunk in _chat(served, "call", stream=True):
        if chunk.choices:
            delta = chunk.choices[0].delta
            reasoning += (delta.model_extra or {}).get("reasoning_content") or ""
            for tc in delta.tool_calls or []:
                name += tc.function.name or ""
                args += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, name, json.loads(args), finish) == ("Forecast wanted.", "get_weather",
                                                           {"city": "Paris", "days": 3}, "tool_calls")
    r = _chat(served, "think")
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == ("Air scatters blue light.", "stop")
    assert r.choices[0].message.model_extra["reasoning_content"] == "Rayleigh."


def test_a_history_call_and_its_result_reach_the_model_as_the_encoder_renders_them(served):
    r = _chat(served, "history")
    assert served[2].decode(r.model_extra["prompt_token_ids"]) == render(*CASES["history"][:2])
    assert r.choices[0].message.content == "Sunny in Paris." and r.choices[0].finish_reason == "stop"


def test_messages_tool_use(served):
    fn = WEATHER["function"]
    r = served[1].messages.create(model="m", max_tokens=128, extra_body={"top_p": 0.95}, messages=CASES["call"][0],
                                  tools=[{"name": fn["name"], "description": fn["description"],
                                          "input_schema": fn["parameters"]}])
    assert r.stop_reason == "tool_use"
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "input", None)) for b in r.content] == [
        ("thinking", "Forecast wanted."), ("tool_use", {"city": "Paris", "days": 3})]


def test_structured_output_starts_in_the_response_channel_and_a_closed_empty_one_releases_it(core):
    """Under an output constraint the K3 answer is the response channel's text: the grammar waits for the whole
    `<|close|>think<|sep|><|open|>response<|sep|>` (several ids) and, with tools parsed, the channel's `<|close|>`
    as its first token releases it for the tools channel. Driven with the ids of the scripted replies through the
    constraint owner's real llguidance state over the core's vocabulary."""
    from helios.core.load import read_manifest
    from helios.frontend.constraints import ConstraintState
    from helios.frontend.context import ModelContext, ModelLimits
    from helios.frontend.structured import output_constraint
    from helios.frontend.tokenizer import Tokenizer
    from helios.frontend.tools import FunctionTool, ToolPlan

    manifest = read_manifest(core)
    tokenizer = Tokenizer.from_file(core / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    ctx = ModelContext.build(manifest, ModelLimits(max_model_len=512, default_max_tokens=16), tokenizer, None)
    grammar = ctx.output_grammars.compile("json_schema", {"type": "object", "properties": {"blue": {"type": "boolean"}},
                                                   "required": ["blue"], "additionalProperties": False})
    prompt = tokenizer.encode(render(*CASES["think"][:2]), add_special_tokens=False)
    spec = output_constraint(ctx, grammar, prompt, None)
    gate = tuple(tokenizer.encode(THINK_CLOSE + RESPONSE_OPEN, add_special_tokens=False))
    assert spec.starts_in_reasoning and spec.close_token_ids == gate and len(gate) > 2
    assert spec.tool_open_token_ids == ()

    state = ConstraintState(spec, ctx.output_grammars.matcher(grammar))
    for token_id in tokenizer.encode("Rayleigh." + THINK_CLOSE, add_special_tokens=False):
        assert state.token_mask() is None  # reasoning (and a partial close) stay free
        state.observe(token_id)
    for token_id in tokenizer.encode(RESPONSE_OPEN, add_special_tokens=False):
        state.observe(token_id)
    for token_id in tokenizer.encode('{"blue":true}', add_special_tokens=False):
        mask = state.token_mask()
        assert mask is not None and mask[token_id >> 3] >> (token_id & 7) & 1
        state.observe(token_id)
    assert state.error is None
    close = tokenizer.encode("<|close|>", add_special_tokens=False)[0]
    assert not state.token_mask()[close >> 3] >> (close & 7) & 1  # the grammar ends in EOS, not the channel close

    plan = ToolPlan(tools=[FunctionTool(name="get_weather", parameters=WEATHER["function"]["parameters"])])
    call_prompt = tokenizer.encode(render(*CASES["call"][:2]), add_special_tokens=False)
    spec = output_constraint(ctx, grammar, call_prompt, plan)
    assert spec.tool_open_token_ids == (close,)
    state = ConstraintState(spec, ctx.output_grammars.matcher(grammar))
    for token_id in tokenizer.encode(CASES["call"][2], add_special_tokens=False):
        state.observe(token_id)
    assert state.phase == "released" and state.error is None
