"""thinking_token_budget end to end: a real engine over a tiny random-weight qwen3 core whose template opens
<think> in the generation prompt, behind the app in-process (Chat, Responses, Messages; buffered and streamed).

The model is random, but its EOS (<|im_end|>) and </think> embedding rows are zero (tied embeddings), so their
logits are 0 while the greedy winner's is positive: it never ends or closes reasoning on its own. Every reply
therefore reasons until the budget forces </think>, then answers until the output limit. The forced close is a
generated token (completion_tokens counts it) but a delimiter, not reasoning (reasoning_tokens == budget), and
has no logprob entry.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import msgspec
import pytest

from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.compose import build_runtime
from helios.server.runtime import Runtime, resolve_serving

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' and message.get('reasoning_content') %}"
    "<think>\n{{ message['reasoning_content'] }}\n</think>\n\n{% endif %}"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)
EOS_ID = 2
MAX_TOKENS = 12
BUDGET = 5
ANTHROPIC = {"anthropic-version": "2023-06-01"}
CHAT = {"messages": [{"role": "user", "content": "Hello world! How are you today?"}], "max_tokens": MAX_TOKENS,
        "temperature": 0}


def build_thinking_checkpoint(out_dir):
    """The tiny qwen3 checkpoint with <think> (300) and </think> (301) as single added tokens."""
    from tokenizers import AddedToken

    from tests.ignition.tiny_models import build_tokenizer, tiny_model, write_tokenizer

    model = tiny_model("qwen3", vocab_size=304)
    tok = build_tokenizer()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in ("<think>", "</think>")])
    import torch

    # tied embeddings: a zero row is a zero logit, never the greedy choice. Zeroed: the specials, both
    # delimiters and every token that is not printable ASCII alone (so reasoning text is never held back as
    # an incomplete UTF-8 sequence and released after the close)
    silent = [i for i in range(tok.get_vocab_size())
              if i in (EOS_ID, 0, 1, 300, 301) or not tok.decode([i]).isascii() or not tok.decode([i]).isprintable()]
    with torch.no_grad():
        model.get_input_embeddings().weight[silent] = 0.0
    model.save_pretrained(out_dir)
    write_tokenizer(out_dir)
    (out_dir / "tokenizer.json").write_text(tok.to_str(), encoding="utf-8")
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    (out_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}, indent=2))
    return out_dir


@pytest.fixture(scope="module")
def thinking_core(tmp_path_factory):
    from ignition.export import ExportOptions, export_core

    tmp = tmp_path_factory.mktemp("thinking")
    src = build_thinking_checkpoint(tmp / "hf")
    return export_core(src, tmp / "core", ExportOptions(dtype="float32", recipe="qwen3"))


@pytest.fixture(scope="module")
def runtimes(thinking_core):
    """(plain, with_default): two runtimes around one engine; the second has [server] thinking_token_budget = 3."""
    plain = build_runtime(thinking_core, ServerConfig(kv_cache_tokens=2048))
    with_default = Runtime(plain.manifest, plain.tokenizer, (thinking_core / "template.jinja").read_text(),
                           plain.engine, ServerConfig(thinking_token_budget=3))
    yield plain, with_default
    plain.shutdown()
    with_default.pool.shutdown(wait=False)


def post_all(runtime, calls):
    """[(path, body, headers)] -> responses, in order, through the app in-process."""

    async def main():
        app = HeliosApp(runtime, warm=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=120) as c:
            return [await c.post(path, json=body, headers=headers or {}) for path, body, headers in calls]

    return asyncio.run(main())


def cuts(runtime) -> int:
    return runtime.engine.metrics().reasoning_budget_cuts


def test_the_core_opens_reasoning_with_single_token_delimiters(runtimes):
    reasoning = runtimes[0].manifest.template.reasoning
    assert reasoning.starts_in_reasoning and (reasoning.open_token_id, reasoning.close_token_id) == (300, 301)


def test_chat_budget_cuts_reasoning_and_the_close_counts_but_has_no_logprob(runtimes):
    plain, _ = runtimes
    before = cuts(plain)
    uncapped, capped = post_all(plain, [
        ("/v1/chat/completions", {**CHAT, "logprobs": True}, None),
        ("/v1/chat/completions", {**CHAT, "logprobs": True, "thinking_token_budget": BUDGET}, None),
    ])
    # without a budget the model reasons to the output limit
    body = uncapped.json()
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == MAX_TOKENS
    assert body["choices"][0]["message"]["content"] == ""
    body = capped.json()
    assert capped.status_code == 200, body
    usage, choice = body["usage"], body["choices"][0]
    assert usage["completion_tokens"] == MAX_TOKENS  # the forced </think> is a generated token ...
    assert usage["completion_tokens_details"]["reasoning_tokens"] == BUDGET  # ... but not reasoning
    assert choice["message"]["reasoning_content"] and choice["message"]["content"]
    assert "</think>" not in choice["message"]["reasoning_content"] + choice["message"]["content"]
    assert len(choice["logprobs"]["content"]) == MAX_TOKENS - 1  # every token but the forced one
    assert choice["finish_reason"] == "length"
    # the uncapped reply's first BUDGET tokens are the capped reply's reasoning (same greedy model)
    assert [e["token"] for e in uncapped.json()["choices"][0]["logprobs"]["content"][:BUDGET]] == \
        [e["token"] for e in choice["logprobs"]["content"][:BUDGET]]
    assert cuts(plain) == before + 1


def test_metrics_report_the_cuts(runtimes):
    plain, _ = runtimes
    post_all(plain, [("/v1/chat/completions", {**CHAT, "thinking_token_budget": 2}, None)])
    text, js = post_all_get(plain, ["/metrics", "/metrics?format=json"])
    count = msgspec.json.decode(js.content)["reasoning_budget_cuts"]
    assert count == cuts(plain) >= 1
    assert f"flare_reasoning_budget_cuts_total {count}.0\n" in text.text
    launches = msgspec.json.decode(js.content)["graph_launches"]  # this CPU engine: eager forwards only
    assert launches["eager"] > 0 and launches["graph"] == launches["speculative"] == 0
    assert f'flare_graph_launches_total{{kind="eager"}} {launches["eager"]}.0\n' in text.text


def post_all_get(runtime, paths):
    async def main():
        app = HeliosApp(runtime, warm=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.get(p) for p in paths]

    return asyncio.run(main())


def test_chat_stream_reasons_then_answers(runtimes):
    plain, _ = runtimes
    (r,) = post_all(plain, [("/v1/chat/completions", {**CHAT, "thinking_token_budget": BUDGET, "stream": True,
                                                       "stream_options": {"include_usage": True}}, None)])
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    kinds = [k for d in deltas for k in ("reasoning_content", "content") if d.get(k)]
    assert kinds and kinds[0] == "reasoning_content" and kinds[-1] == "content"
    assert kinds == sorted(kinds, key=lambda k: k == "content")  # all reasoning first, then all answer
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS
    assert usage["completion_tokens_details"]["reasoning_tokens"] == BUDGET


def test_responses_budget(runtimes):
    plain, _ = runtimes
    body = {"input": "Hello world! How are you today?", "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "thinking_token_budget": BUDGET}
    (r,) = post_all(plain, [("/v1/responses", body, None)])
    out = r.json()
    assert r.status_code == 200, out
    assert [item["type"] for item in out["output"]] == ["reasoning", "message"]
    assert out["usage"]["output_tokens"] == MAX_TOKENS
    assert out["usage"]["output_tokens_details"]["reasoning_tokens"] == BUDGET
    assert out["status"] == "incomplete"


def test_messages_thinking_budget_tokens_caps_reasoning(runtimes):
    plain, _ = runtimes
    base = {"max_tokens": MAX_TOKENS, "temperature": 0, "messages": [{"role": "user", "content": "Hello world!"}]}
    before = cuts(plain)
    capped, both, huge = post_all(plain, [
        ("/v1/messages", {**base, "thinking": {"type": "enabled", "budget_tokens": BUDGET}}, ANTHROPIC),
        ("/v1/messages", {**base, "thinking": {"type": "adaptive", "budget_tokens": BUDGET},
                          "thinking_token_budget": BUDGET}, ANTHROPIC),
        # above the 32-bit output limit: accepted, never cut
        ("/v1/messages", {**base, "thinking": {"type": "enabled", "budget_tokens": 2**31 + 5}}, ANTHROPIC),
    ])
    for r in (capped, both):
        out = r.json()
        assert r.status_code == 200, out
        assert [b["type"] for b in out["content"]] == ["thinking", "text"]
        assert out["usage"]["output_tokens"] == MAX_TOKENS and out["stop_reason"] == "max_tokens"
    out = huge.json()
    assert huge.status_code == 200, out
    assert [b["type"] for b in out["content"]] == ["thinking"]
    assert cuts(plain) == before + 2


def test_server_default_applies_and_an_explicit_budget_wins(runtimes):
    _, with_default = runtimes
    omitted, null, explicit, messages = post_all(with_default, [
        ("/v1/chat/completions", CHAT, None),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": None}, None),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 6}, None),
        ("/v1/messages", {"max_tokens": MAX_TOKENS, "temperature": 0,
                          "messages": [{"role": "user", "content": "Hello world!"}]}, ANTHROPIC),
    ])
    reasoning = [r.json()["usage"]["completion_tokens_details"]["reasoning_tokens"] for r in (omitted, null, explicit)]
    assert reasoning == [3, 3, 6]
    assert [b["type"] for b in messages.json()["content"]] == ["thinking", "text"]
    (models,) = post_all_get(with_default, ["/v1/models"])
    assert models.json()["data"][0]["flare"]["thinking_token_budget"] == 3


def test_output_starting_in_content_is_accepted_without_a_cut(runtimes):
    """An assistant history whose reasoning closed, continued as a prefill: output starts in content."""
    plain, _ = runtimes
    before = cuts(plain)
    body = {**CHAT, "thinking_token_budget": 1, "add_generation_prompt": False, "continue_final_message": True,
            "messages": [*CHAT["messages"], {"role": "assistant", "content": "Fine", "reasoning_content": "hm"}]}
    (r,) = post_all(plain, [("/v1/chat/completions", body, None)])
    out = r.json()
    assert r.status_code == 200, out
    assert cuts(plain) == before
    # the output parser agrees: the continuation is answer text, not reasoning
    message = out["choices"][0]["message"]
    assert message["reasoning_content"] is None and message["content"]
    assert out["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0


def test_the_budget_is_rejected_where_it_cannot_apply(runtimes):
    plain, _ = runtimes
    bad = post_all(plain, [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "thinking_token_budget": 3}, None),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 0}, None),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 2**31}, None),
        ("/v1/responses", {"input": "hi", "thinking_token_budget": -1}, None),
        ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                          "thinking": {"type": "enabled", "budget_tokens": 0}}, ANTHROPIC),
    ])
    for r in bad:
        assert r.status_code == 400, r.text
    for r in bad[:4]:
        assert r.json()["error"]["param"] == "thinking_token_budget", r.text


def test_startup_rejects_a_default_the_core_cannot_honour(runtimes):
    manifest = runtimes[0].manifest
    config = ServerConfig(thinking_token_budget=8)
    resolve_serving(manifest, config)  # this core can
    syntax = manifest.template.reasoning
    cases = {
        "reasoning syntax": None,
        "single-token reasoning close": msgspec.structs.replace(syntax, close_token_id=None),
        "opens reasoning": msgspec.structs.replace(syntax, starts_in_reasoning=False),
    }
    for words, reasoning in cases.items():
        template = msgspec.structs.replace(manifest.template, reasoning=reasoning)
        with pytest.raises(ValueError, match=f"thinking_token_budget needs .*{words}"):
            resolve_serving(msgspec.structs.replace(manifest, template=template), config)


def test_tool_openers_that_end_reasoning_reach_the_engine():
    """Qwen XML recognizes calls inside reasoning: its single-token <tool_call> goes to the engine (which then
    never cuts); Hermes does not, and without parsed tools there is nothing to wait for."""
    from types import SimpleNamespace

    from helios.core.manifest import ReasoningSyntax
    from helios.frontend.reasoning import reasoning_budget

    syntax = ReasoningSyntax(open="<think>", close="</think>", open_token_id=300, close_token_id=301,
                             starts_in_reasoning=True)
    pieces = {"<tool_call>": [302], "<function=": [40, 41]}

    def model(tool_parser, default=None):
        manifest = SimpleNamespace(template=SimpleNamespace(reasoning=syntax),
                                   recipe=SimpleNamespace(tool_parser=tool_parser))
        return SimpleNamespace(manifest=manifest, limits=SimpleNamespace(thinking_token_budget=default),
                               tokenizer=SimpleNamespace(encode=lambda text, add_special_tokens: pieces[text]))

    prompt = [5, 300, 6]
    got = reasoning_budget(model("qwen_xml"), 7, prompt, parses_tools=True)
    assert (got.max_reasoning_tokens, got.close_token_id, got.starts_in_reasoning) == (7, 301, True)
    assert got.tool_open_token_ids == (302,)
    assert reasoning_budget(model("qwen_xml"), 7, prompt, parses_tools=False).tool_open_token_ids == ()
    assert reasoning_budget(model("hermes"), 7, prompt, parses_tools=True).tool_open_token_ids == ()
    # the default applies only when the request names none; none at all leaves reasoning uncapped
    assert reasoning_budget(model(None, default=4), None, prompt).max_reasoning_tokens == 4
    assert reasoning_budget(model(None), None, prompt) is None
    # the prompt closed reasoning (e.g. enable_thinking=false): output starts in content
    assert not reasoning_budget(model(None), 7, [300, 9, 301, 10]).starts_in_reasoning


def test_without_reasoning_syntax_messages_budgets_are_advisory(runtimes, thinking_core):
    """The same engine behind a manifest without reasoning syntax: Messages thinking.budget_tokens is only a
    hint (200, no cut); an explicit thinking_token_budget is a 400 naming it on every route."""
    plain, _ = runtimes
    template = msgspec.structs.replace(plain.manifest.template, reasoning=None)
    manifest = msgspec.structs.replace(plain.manifest, template=template)
    bare = Runtime(manifest, plain.tokenizer, (thinking_core / "template.jinja").read_text(), plain.engine,
                   ServerConfig())
    before = cuts(plain)
    base = {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    hint, explicit, chat = post_all(bare, [
        ("/v1/messages", {**base, "thinking": {"type": "enabled", "budget_tokens": 1}}, ANTHROPIC),
        ("/v1/messages", {**base, "thinking_token_budget": 1}, ANTHROPIC),
        ("/v1/chat/completions", {**CHAT, "thinking_token_budget": 1}, None),
    ])
    bare.pool.shutdown(wait=False)
    assert hint.status_code == 200 and hint.json()["usage"]["output_tokens"] == 4
    assert cuts(plain) == before
    assert explicit.status_code == 400 and "thinking_token_budget" in explicit.json()["error"]["message"]
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "thinking_token_budget"


def test_helios_serve_refuses_a_default_budget_on_a_core_without_reasoning(tmp_path):
    """The default SmolLM2 core has no reasoning syntax: one line naming the setting, before any serving."""
    import subprocess

    from tests.server.conftest import CORE, HELIOS, ROOT

    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    config = tmp_path / "helios.toml"
    config.write_text("[server]\nthinking_token_budget = 64\n", encoding="utf-8")
    done = subprocess.run([str(HELIOS), "serve", str(CORE), "--config", str(config), "--port", "0"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    assert len(lines) == 1 and "thinking_token_budget needs a core with reasoning syntax" in lines[0], lines


def test_an_output_grammar_starts_after_the_forced_close(runtimes):
    """Reasoning is free; after the budget forces </think> the answer follows the grammar, then EOS (the only
    token the finished grammar allows, though this model never picks it on its own): finish "stop"."""
    plain, _ = runtimes
    grammar = {"structured_outputs": {"regex": "[a-z]{4}"}, "max_tokens": 20}
    capped, uncapped = post_all(plain, [
        ("/v1/chat/completions", {**CHAT, **grammar, "thinking_token_budget": BUDGET, "logprobs": True}, None),
        ("/v1/chat/completions", {**CHAT, **grammar}, None),
    ])
    body = capped.json()
    assert capped.status_code == 200, body
    choice = body["choices"][0]
    import re

    assert re.fullmatch("[a-z]{4}", choice["message"]["content"]), choice
    assert choice["message"]["reasoning_content"] and choice["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] == BUDGET
    # spec: under a grammar, reasoning that never closes runs to the limit without an answer
    choice = uncapped.json()["choices"][0]
    assert choice["message"]["content"] == "" and choice["finish_reason"] == "length"
