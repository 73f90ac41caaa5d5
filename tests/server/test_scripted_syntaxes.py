"""End to end with real exported cores for the syntaxes no available model speaks: Qwen XML, GLM, Gemma 4, MiniMax,
MiMo and DeepSeek DSML tool calls, with their reasoning delimiters.

The speakers are tests/fixtures/scripted_model.py's: tiny models trained in the fixture to reproduce scripted
replies for scripted prompts, exported by ignition once per recipe. Each syntax is spoken by a tiny model of its
recipe's own family: Qwen XML (qwen38_dense) by qwen3_5, GLM (glm53) by glm5_next, Gemma 4 by gemma4, MiniMax by
minimax_m3, MiMo by mimo_v2_flash, DSML (deepseek4) by deepseek_v4, whose prompts DeepSeek V4's native encoder
renders (no Jinja template) and whose calls are V4's DSML spelling.
One real `helios serve` per core (module-scoped, parametrized, so one runs at a time); the official openai and
anthropic SDKs drive Chat Completions, Messages and Responses, buffered and streaming, at temperature 0 (clamped to
the recipe's range, top-p 0.95: the scripted token is the only one kept). Nothing is mocked: template, tokenizer,
engine, sampler, parsers and encoders all run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest

from tests.fixtures.scripted_model import (HELLO, NAMED_TEXT, OSLO, PARIS, ROME, SKY, SYNTAXES, TOKYO, Case,
                                           ScriptedCores, case, export_cores, num_tokens_through, render_prompt,
                                           scripted_cases)
from tests.server.conftest import ANTHROPIC_VERSION, _stop, serve_core

MAX_TOKENS = 96
APIS = ("chat", "messages", "responses")
MODES = ("buffered", "stream")
THOUGHTS = {"call": "Forecast wanted.", "two": "Two cities.", "required": "No tool.", "named": "Time wanted.",
            "think": "Rayleigh.", "incomplete": "Forecast wanted.", "implicit": "Time wanted.",
            "required_call": "Forecast wanted.", "named_other": "Weather it is."}


@pytest.fixture(scope="session")
def scripted(tmp_path_factory) -> ScriptedCores:
    return export_cores(tmp_path_factory.mktemp("scripted"))


@dataclass
class Served:
    tag: str
    core: Path
    url: str
    openai: Any
    anthropic: Any


@pytest.fixture(scope="module", params=list(SYNTAXES))
def served(request, scripted, tmp_path_factory):
    import anthropic
    import openai

    tag = request.param
    tmp = tmp_path_factory.mktemp(f"serve-{tag}")
    config = tmp / "server.toml"
    config.write_text("[server]\n", encoding="utf-8")
    proc, url = serve_core(scripted.cores[tag], config, tmp / "serve.log", timeout_s=120, poll_s=0.2)
    try:
        with (openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60) as oa,
              anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60) as an):
            yield Served(tag, scripted.cores[tag], url, oa, an)
    finally:
        _stop(proc)


# the family each recipe's served core must be of (the llama speaks any other)
FAMILIES = {"mimo": "mimo_v2_flash", "minimax": "minimax_m3", "gemma": "gemma4", "qwen": "qwen3_5",
            "glm": "glm5_next", "dsml": "deepseek_v4"}


def test_served_core_is_of_the_recipes_family(served):
    """The core served for each syntax is of its recipe's own family, under that recipe; DSML's deepseek_v4 core
    renders its prompts with DeepSeek V4's native encoder and parses V4's DSML spelling."""
    from helios.core.load import read_manifest

    manifest = read_manifest(served.core)
    assert manifest.recipe.name == SYNTAXES[served.tag].recipe
    assert manifest.arch.family == FAMILIES.get(served.tag, "llama")
    native = SYNTAXES[served.tag].native
    assert manifest.template.kind == (native or "jinja")
    if native:
        assert manifest.recipe.tool_parser == "dsml_v4"


# --- request bodies: one builder per API, shared by the prompt check and the SDK calls -----------------------


def _body(api: str, c: Case, stream: bool = False, parallel: bool = True, max_tokens: int = MAX_TOKENS,
          choice: str | None = None) -> dict:
    """The request for case `c`; `choice` overrides its tool_choice mode ("none": tools declared, not parsed)."""
    fns = [t["function"] for t in c.tools]
    c = Case(c.syntax, c.kind, c.user, c.reply, c.tools, choice or c.mode, c.named)
    user = [{"role": "user", "content": c.user}]
    if api == "chat":
        body: dict[str, Any] = dict(model="scripted", messages=user, temperature=0, seed=0, max_tokens=max_tokens)
        if fns:
            body["tools"] = [{"type": "function", "function": fn} for fn in fns]
            body["tool_choice"] = ({"type": "function", "function": {"name": c.named}} if c.mode == "named"
                                   else c.mode)
            if not parallel:
                body["parallel_tool_calls"] = False
        if stream:
            body.update(stream=True, stream_options={"include_usage": True})
        return body
    if api == "messages":
        # NOTE: the pinned SDK's create() has no temperature argument; the server reads the field from the body
        body = dict(model="scripted", messages=user, max_tokens=max_tokens, extra_body={"temperature": 0, "seed": 0})
        if fns:
            body["tools"] = [{"name": fn["name"], "description": fn["description"], "input_schema": fn["parameters"]}
                             for fn in fns]
            choice = {"auto": {"type": "auto"}, "required": {"type": "any"}, "none": {"type": "none"},
                      "named": {"type": "tool", "name": c.named}}[c.mode]
            body["tool_choice"] = choice if parallel else {**choice, "disable_parallel_tool_use": True}
        if stream:
            body["stream"] = True
        return body
    body = dict(model="scripted", input=c.user, temperature=0, max_output_tokens=max_tokens,
                extra_body={"seed": 0})
    if fns:
        body["tools"] = [{"type": "function", "name": fn["name"], "description": fn["description"],
                          "parameters": fn["parameters"], "strict": False} for fn in fns]
        body["tool_choice"] = {"type": "function", "name": c.named} if c.mode == "named" else c.mode
        if not parallel:
            body["parallel_tool_calls"] = False
    if stream:
        body["stream"] = True
    return body


def _wire(body: dict) -> bytes:
    """The JSON an SDK sends for these keyword arguments (extra_body merged in)."""
    body = dict(body)
    body.update(body.pop("extra_body", {}))
    return msgspec.json.encode(body)


# --- one request through an SDK -> a normalized outcome ------------------------------------------------------


@dataclass
class Outcome:
    reasoning: str = ""
    text: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)
    finish: str | None = None  # Chat finish_reason, Messages stop_reason, Responses status
    reasoning_tokens: int | None = None
    completion_tokens: int | None = None
    error: str | None = None  # HTTP 500 message (buffered) or the terminal error event (streamed)
    terminated: bool = False  # a streamed success terminator arrived ([DONE], message_stop, response.completed)


def _chat(s: Served, body: dict) -> Outcome:
    import openai
    from openai.types.chat import ChatCompletionMessageToolCall

    out = Outcome()
    if not body.get("stream"):
        try:
            r = s.openai.chat.completions.create(**body)
        except openai.InternalServerError as e:
            assert e.status_code == 500
            return Outcome(error=e.message)
        choice = r.choices[0]
        msg = choice.message
        for call in msg.tool_calls or []:
            assert isinstance(call, ChatCompletionMessageToolCall) and call.type == "function"
            assert call.id.startswith("call_")
            out.calls.append((call.function.name, json.loads(call.function.arguments)))
        out.reasoning, out.text = getattr(msg, "reasoning_content", None) or "", msg.content or ""
        out.finish = choice.finish_reason
        out.completion_tokens = r.usage.completion_tokens
        out.reasoning_tokens = r.usage.completion_tokens_details.reasoning_tokens
        return out
    calls: dict[int, list[str]] = {}
    stream = s.openai.chat.completions.create(**body)
    try:
        for chunk in stream:
            if chunk.usage is not None:
                out.completion_tokens = chunk.usage.completion_tokens
                out.reasoning_tokens = chunk.usage.completion_tokens_details.reasoning_tokens
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            out.text += ch.delta.content or ""
            out.reasoning += getattr(ch.delta, "reasoning_content", None) or ""
            for tc in ch.delta.tool_calls or []:
                part = calls.setdefault(tc.index, ["", ""])
                if tc.id:
                    assert tc.id.startswith("call_")
                part[0] += tc.function.name or ""
                part[1] += tc.function.arguments or ""
            if ch.finish_reason is not None:
                out.finish = ch.finish_reason
        out.terminated = True  # the SDK stops at [DONE]; an error chunk raises instead
    except openai.APIError as e:
        out.error = e.message
    out.calls = [(name, json.loads(args)) for _, (name, args) in sorted(calls.items())]
    return out


def _messages(s: Served, body: dict) -> Outcome:
    import anthropic
    from anthropic.types import TextBlock, ThinkingBlock, ToolUseBlock

    out = Outcome()
    if not body.get("stream"):
        try:
            r = s.anthropic.messages.create(**body)
        except anthropic.InternalServerError as e:
            assert e.status_code == 500
            return Outcome(error=str(e))
        for block in r.content:
            if isinstance(block, ThinkingBlock):
                assert block.signature.startswith("flare-thinking-v1:")
                out.reasoning += block.thinking
            elif isinstance(block, TextBlock):
                out.text += block.text
            else:
                assert isinstance(block, ToolUseBlock) and block.id.startswith("toolu_")
                out.calls.append((block.name, block.input))
        out.finish, out.completion_tokens = r.stop_reason, r.usage.output_tokens
        return out
    blocks: dict[int, list] = {}
    try:
        for ev in s.anthropic.messages.create(**body):
            if ev.type == "content_block_start":
                cb = ev.content_block
                blocks[ev.index] = [cb.type, getattr(cb, "name", None), ""]
                if cb.type == "tool_use":
                    assert cb.input == {} and cb.id.startswith("toolu_")
            elif ev.type == "content_block_delta":
                d = ev.delta
                text = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
                if d.type in text:
                    blocks[ev.index][2] += getattr(d, text[d.type])
            elif ev.type == "message_delta":
                out.finish, out.completion_tokens = ev.delta.stop_reason, ev.usage.output_tokens
            elif ev.type == "message_stop":
                out.terminated = True
    except anthropic.APIError as e:  # the SDK raises on an `error` event
        out.error = str(e)
    for kind, name, text in (blocks[i] for i in sorted(blocks)):
        if kind == "thinking":
            out.reasoning += text
        elif kind == "text":
            out.text += text
        else:
            out.calls.append((name, json.loads(text)))
    return out


def _responses(s: Served, body: dict) -> Outcome:
    import openai

    out = Outcome()

    def read(items) -> None:
        for item in items:
            if item.type == "reasoning":
                assert item.summary == []
                out.reasoning += "".join(part.text for part in item.content or [])
            elif item.type == "message":
                out.text += "".join(part.text for part in item.content)
            else:
                assert item.type == "function_call" and item.call_id.startswith("call_")
                out.calls.append((item.name, json.loads(item.arguments)))

    if not body.get("stream"):
        try:
            r = s.openai.responses.create(**body)
        except openai.InternalServerError as e:
            assert e.status_code == 500
            return Outcome(error=e.message)
        read(r.output)
        out.finish = r.status
        if r.status == "incomplete":
            assert r.incomplete_details.reason == "max_output_tokens"
        out.completion_tokens = r.usage.output_tokens
        out.reasoning_tokens = r.usage.output_tokens_details.reasoning_tokens
        return out
    done = []
    for ev in s.openai.responses.create(**body):
        if ev.type == "response.output_item.done":
            done.append(ev.item)
        elif ev.type in ("response.completed", "response.incomplete"):
            out.terminated, out.finish = True, ev.response.status
            if ev.type == "response.incomplete":
                assert ev.response.incomplete_details.reason == "max_output_tokens"
            out.completion_tokens = ev.response.usage.output_tokens
            out.reasoning_tokens = ev.response.usage.output_tokens_details.reasoning_tokens
        elif ev.type == "response.failed":
            out.finish, out.error = ev.response.status, ev.response.error.message
    read(done)
    return out


CALL = {"chat": _chat, "messages": _messages, "responses": _responses}
TOOL_FINISH = {"chat": "tool_calls", "messages": "tool_use", "responses": "completed"}
LIMIT_FINISH = {"chat": "length", "messages": "max_tokens", "responses": "incomplete"}
STOP_FINISH = {"chat": "stop", "messages": "end_turn", "responses": "completed"}


def _run(s: Served, api: str, c: Case, mode: str, **kw) -> Outcome:
    return CALL[api](s, _body(api, c, stream=mode == "stream", **kw))


def _num_reply_tokens(s: Served, c: Case) -> int:
    from tokenizers import Tokenizer

    return len(Tokenizer.from_file(str(s.core / "tokenizer.json")).encode(c.reply, add_special_tokens=False).ids)


# --- tests ---------------------------------------------------------------------------------------------------


def test_helios_renders_the_scripted_prompts(served):
    """Every request the tests send renders to the prompt the model was trained on, on all three APIs."""
    from helios.core.load import read_manifest
    from helios.frontend.tokenizer import Tokenizer
    from helios.server.config import ServerConfig
    from helios.server.protocols import anthropic_messages, openai_chat, openai_responses
    from helios.server.runtime import Runtime

    manifest = read_manifest(served.core)
    tok = Tokenizer.from_file(served.core / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    jinja = served.core / "template.jinja"  # none for a native encoder (DSML)
    runtime = Runtime(manifest, tok, jinja.read_text() if jinja.is_file() else None, None, ServerConfig())
    try:
        assert manifest.template.tools and manifest.recipe.name == SYNTAXES[served.tag].recipe
        for c in (c for c in scripted_cases() if c.syntax == served.tag):
            want = tok.encode(render_prompt(c), add_special_tokens=False)
            assert openai_chat.prepare(_wire(_body("chat", c)), runtime.model).prompt_ids == want, c
            assert anthropic_messages.prepare(_wire(_body("messages", c)), runtime.model).prompt_ids == want, c
            assert openai_responses.prepare(_wire(_body("responses", c)), runtime.model).prompt_ids == want, c
        # tool_choice none presents the tools too: its requests reuse the "call" prompt
        c = case(served.tag, "call")
        want = tok.encode(render_prompt(c), add_special_tokens=False)
        assert openai_chat.prepare(_wire(_body("chat", c, choice="none")), runtime.model).prompt_ids == want
        assert anthropic_messages.prepare(_wire(_body("messages", c, choice="none")), runtime.model).prompt_ids == want
        assert openai_responses.prepare(_wire(_body("responses", c, choice="none")), runtime.model).prompt_ids == want
    finally:
        runtime.pool.shutdown(wait=False)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_tool_call(served, api, mode):
    """A declared tool called: the SDK's tool-call type, name and arguments JSON (typed by the schema where the
    syntax carries text), the reasoning before it, tool_calls / tool_use / a completed function_call item."""
    c = case(served.tag, "call")
    out = _run(served, api, c, mode)
    assert out.error is None, out.error
    assert out.calls == [PARIS] and out.text == ""
    assert out.reasoning.strip() == THOUGHTS["call"]
    assert out.finish == TOOL_FINISH[api]
    assert out.completion_tokens == _num_reply_tokens(served, c) + 1  # the reply and its EOS
    if api != "messages":  # Anthropic usage has no reasoning count
        assert out.reasoning_tokens and out.reasoning_tokens > 0
    assert out.terminated == (mode == "stream")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_two_calls_and_parallel_tool_calls_false(served, api, mode):
    """Two calls in one reply: both returned in order; with parallel calls disabled the second one fails the
    response (HTTP 500 buffered; streamed: a terminal error, perhaps after the first call, and no success end)."""
    c = case(served.tag, "two")
    out = _run(served, api, c, mode)
    assert out.error is None and out.calls == [PARIS, ROME] and out.finish == TOOL_FINISH[api]
    bad = _run(served, api, c, mode, parallel=False)
    assert bad.error and "parallel" in bad.error, bad
    assert bad.calls in ([], [PARIS]) and not bad.terminated
    if api == "responses" and mode == "stream":
        assert bad.finish == "failed"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_required_without_a_call_fails(served, api, mode):
    """tool_choice required (Messages: any) and a reply with no call: 500, or a terminal error event."""
    c = case(served.tag, "required")
    out = _run(served, api, c, mode)
    assert out.error and "tool_choice" in out.error, out
    assert out.calls == [] and not out.terminated
    assert out.text.lstrip("\n") in ("", HELLO)  # a stream may deliver the text before the error


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_required_with_a_call(served, api, mode):
    """Required mode (its instruction in the prompt) and a reply that calls a declared tool: an ordinary success."""
    out = _run(served, api, case(served.tag, "required_call"), mode)
    assert out.error is None, out.error
    assert out.calls == [ROME] and out.text == "" and out.reasoning.strip() == THOUGHTS["required_call"]
    assert out.finish == TOOL_FINISH[api] and out.terminated == (mode == "stream")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_named_choice_and_a_call_to_another_tool_fails(served, api, mode):
    """Named get_time, but the model calls get_weather: 500 buffered, a terminal error streamed, and the call to the
    other tool is never emitted."""
    out = _run(served, api, case(served.tag, "named_other"), mode)
    assert out.error and "get_weather" in out.error, out
    assert out.calls == [] and OSLO[1]["city"] not in out.text and not out.terminated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_named_choice_hides_answer_text(served, api, mode):
    """A named tool_choice presents one tool; the reply's answer text is omitted, reasoning and the call kept, and
    usage counts every generated token."""
    c = case(served.tag, "named")
    out = _run(served, api, c, mode)
    assert out.error is None, out.error
    assert out.calls == [TOKYO] and out.text == "" and NAMED_TEXT.strip() not in out.reasoning
    assert out.reasoning.strip() == THOUGHTS["named"]
    assert out.finish == TOOL_FINISH[api]
    assert out.completion_tokens == _num_reply_tokens(served, c) + 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_think_reasoning(served, api, mode):
    """Reasoning then an answer, no tools: returned as reasoning (Chat reasoning_content, a Messages thinking
    block, a Responses reasoning item) with reasoning_tokens in usage; the answer is the text after the close.
    Qwen and DSML open reasoning in the generation prompt; the others generate their open delimiter."""
    c = case(served.tag, "think")
    out = _run(served, api, c, mode)
    assert out.error is None and out.calls == []
    # NOTE: the newlines between the close delimiter and the answer (Qwen, MiniMax, MiMo) are answer text
    assert out.reasoning.strip() == THOUGHTS["think"] and out.text.lstrip("\n") == SKY
    assert out.finish == STOP_FINISH[api]
    assert out.completion_tokens == _num_reply_tokens(served, c) + 1
    if api != "messages":  # Anthropic usage has no reasoning count
        assert out.reasoning_tokens and 1 <= out.reasoning_tokens < out.completion_tokens


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_incomplete_call_at_natural_completion_fails(served, api, mode):
    """EOS inside a recognized envelope (right after "Paris"): an error, never a call or a success end."""
    out = _run(served, api, case(served.tag, "incomplete"), mode)
    assert out.error and "incomplete" in out.error, out
    assert out.calls == [] and not out.terminated


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_output_limit_inside_an_envelope(served, api, mode):
    """max_tokens ends generation one token after the call's tool name: the truncated envelope is omitted, no error,
    and the limit is the finish reason (length, max_tokens, incomplete with max_output_tokens)."""
    c = case(served.tag, "call")
    name_end = c.reply.index("get_weather", c.reply.index(SYNTAXES[served.tag].close)) + len("get_weather")
    limit = num_tokens_through(served.core / "tokenizer.json", c, c.reply[:name_end]) + 1
    out = _run(served, api, c, mode, max_tokens=limit)
    assert out.error is None, out.error
    assert out.calls == [] and out.text == "" and out.reasoning.strip() == THOUGHTS["call"]
    assert out.finish == LIMIT_FINISH[api] and out.completion_tokens == limit


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_output_limit_after_a_completed_call(served, api, mode):
    """The limit lands one token after the first of two calls completed: that call is returned, and the finish
    reason is still the limit's, not tool_calls / tool_use."""
    c = case(served.tag, "two")
    first = SYNTAXES[served.tag].calls([PARIS])  # as written alone: a prefix of the two calls, except in a block
    end = {"minimax": "</invoke>", "dsml": "\uff5cinvoke>"}.get(served.tag)
    part = c.reply[: c.reply.index(end) + len(end)] if end else c.reply[: c.reply.index(first) + len(first)]
    limit = num_tokens_through(served.core / "tokenizer.json", c, part) + 1
    out = _run(served, api, c, mode, max_tokens=limit)
    assert out.error is None, out.error
    assert out.calls == [PARIS] and out.finish == LIMIT_FINISH[api] and out.completion_tokens == limit


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_tool_choice_none_leaves_the_syntax_as_text(served, api, mode):
    """tool_choice none: the tools are still presented (same prompt), the call syntax comes back as answer text,
    reasoning is still parsed, and the finish is an ordinary stop."""
    c = case(served.tag, "call")
    out = _run(served, api, c, mode, choice="none")
    assert out.error is None and out.calls == []
    assert out.reasoning.strip() == THOUGHTS["call"]
    assert out.text.lstrip("\n") == SYNTAXES[served.tag].answer(c.reply).lstrip("\n")
    assert out.finish == STOP_FINISH[api]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("api", APIS)
def test_call_inside_reasoning(served, api, mode):
    """A call written inside reasoning (no close delimiter, then EOS): Qwen's and GLM's calls end the reasoning and
    are returned, and so do MiMo's (Qwen's function tags); in Gemma 4, MiniMax and DSML the tool parser never sees
    reasoning, so the call stays reasoning text."""
    c = case(served.tag, "implicit")
    out = _run(served, api, c, mode)
    assert out.error is None, out.error
    if served.tag in ("qwen", "glm", "mimo"):
        assert out.calls == [TOKYO] and out.text == "" and out.reasoning.strip() == THOUGHTS["implicit"]
        assert out.finish == TOOL_FINISH[api]
    else:
        opener = {"gemma": "<|channel>thought", "minimax": "<mm:think>", "dsml": ""}[served.tag]
        assert out.calls == [] and out.text == "" and out.finish == STOP_FINISH[api]
        assert out.reasoning.strip() == c.reply.replace(opener, "", 1).strip()
