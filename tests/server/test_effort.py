"""Reasoning effort over HTTP: Chat reasoning_effort (and chat_template_kwargs), Responses reasoning.effort and
Messages output_config.effort / thinking.budget_tokens reach the prepared template as its own vocabulary.

One tiny qwen3 checkpoint whose template prints `[effort=<reasoning_effort>]` after the generation prompt is
exported with ignition under several recipes (qwen38 low/medium/xhigh, deepseek4, deepseek41 with scores
1..100, kimi3 default max, and qwen3 without a vocabulary). The app runs in-process around a recording engine:
what the frontend rendered is exactly the prompt the engine received, decoded here.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from helios.core.load import read_manifest
from helios.engine.messages import EngineOutput
from helios.frontend.tokenizer import Tokenizer
from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.server.runtime import Runtime

TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "[effort={{ reasoning_effort | default('unset') }}]\n{% endif %}"
)
RECIPES = ("qwen38", "deepseek4", "deepseek41", "kimi3", "qwen3")
ANTHROPIC = {"anthropic-version": "2023-06-01"}
CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
RESPONSES = {"input": "Hello", "max_output_tokens": 4}
MESSAGES = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
ROUTES = {"chat": ("/v1/chat/completions", CHAT), "responses": ("/v1/responses", RESPONSES),
          "messages": ("/v1/messages", MESSAGES), "count": ("/v1/messages/count_tokens", MESSAGES)}


class RecordingEngine:
    """Records each submitted prompt and ends the request with EOS at once."""

    def __init__(self, eos: int):
        self.eos = eos
        self.prompts: list[list[int]] = []
        self.is_healthy = True
        self.error = None

    async def submit(self, request):
        self.prompts.append(list(request.prompt_token_ids))

        async def stream():
            yield EngineOutput(req_id=request.req_id, new_token_ids=[self.eos], finished=True, finish_reason="stop",
                               stop_token=self.eos, num_prompt_tokens=len(request.prompt_token_ids))

        return stream()

    def abort(self, req_id):
        pass


@pytest.fixture(scope="module")
def cores(tmp_path_factory):
    from ignition.export import ExportOptions, export_core
    from tests.ignition.tiny_models import build_tiny

    tmp = tmp_path_factory.mktemp("effort")
    src = build_tiny("qwen3", tmp / "hf")
    config = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return {name: export_core(src, tmp / name, ExportOptions(dtype="float32", recipe=name)) for name in RECIPES}


def call(core, route: str, extra: dict, headers: dict | None = None):
    """(response, the rendered prompt the engine received or None) for one request on a fresh runtime."""
    manifest = read_manifest(core)
    tokenizer = Tokenizer.from_file(core / manifest.tokenizer.file, manifest.tokenizer, manifest.arch.vocab_size)
    engine = RecordingEngine(manifest.tokenizer.eos_token_ids[0])
    runtime = Runtime(manifest, tokenizer, (core / "template.jinja").read_text(), engine, ServerConfig())
    path, base = ROUTES[route]
    if route in ("messages", "count"):
        headers = {**ANTHROPIC, **(headers or {})}

    async def main():
        app = HeliosApp(runtime, warm=False)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, json={**base, **extra}, headers=headers or {})

    try:
        r = asyncio.run(main())
    finally:
        runtime.pool.shutdown(wait=False)
    prompt = tokenizer.decode(engine.prompts[0]) if engine.prompts else None
    return r, prompt


def effort_of(prompt: str) -> str:
    return prompt.rsplit("[effort=", 1)[1].split("]", 1)[0]


def rendered(core, route, extra) -> str:
    r, prompt = call(core, route, extra)
    assert r.status_code == 200, r.text
    return effort_of(prompt)


def test_the_template_reads_reasoning_effort_and_the_recipe_carries_the_vocabulary(cores):
    manifest = read_manifest(cores["qwen38"])
    assert manifest.template.kwargs == ["reasoning_effort"]
    assert manifest.recipe.effort_levels == ["low", "medium", "xhigh"]


@pytest.mark.parametrize("effort,level", [(None, "unset"), ("none", "low"), ("minimal", "low"), ("low", "low"),
                                          ("medium", "medium"), ("high", "xhigh"), ("xhigh", "xhigh"),
                                          ("max", "xhigh")])
def test_chat_and_responses_map_neutral_levels_into_qwen_vocabulary(cores, effort, level):
    assert rendered(cores["qwen38"], "chat", {"reasoning_effort": effort}) == level
    assert rendered(cores["qwen38"], "responses", {"reasoning": {"effort": effort}}) == level


def test_chat_template_kwargs_is_the_native_option_and_wins(cores):
    core = cores["qwen38"]
    assert rendered(core, "chat", {"chat_template_kwargs": {"reasoning_effort": "medium"}}) == "medium"
    assert rendered(core, "chat", {"reasoning_effort": "low",
                                   "chat_template_kwargs": {"reasoning_effort": "high"}}) == "xhigh"


def test_recipe_default_effort_applies_when_the_request_names_none(cores):
    assert rendered(cores["kimi3"], "chat", {}) == "max"
    assert rendered(cores["kimi3"], "responses", {}) == "max"
    assert rendered(cores["kimi3"], "messages", {}) == "max"
    assert rendered(cores["kimi3"], "chat", {"reasoning_effort": "medium"}) == "high"
    assert rendered(cores["deepseek4"], "chat", {"reasoning_effort": "medium"}) == "high"


@pytest.mark.parametrize("extra,level", [
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "low"),
    ({"thinking": {"type": "enabled", "budget_tokens": 5000}}, "low"),
    ({"thinking": {"type": "adaptive", "budget_tokens": 5001}}, "high"),
    ({"thinking": {"type": "enabled", "budget_tokens": 20000}}, "high"),
    ({"thinking": {"type": "enabled", "budget_tokens": 20001}}, "max"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}, "output_config": {"effort": "max"}}, "max"),
    ({"thinking": {"type": "enabled", "budget_tokens": 30000}, "output_config": {"effort": "low"}}, "low"),
    ({"thinking": {"type": "disabled"}}, "max"),  # no budget: the recipe default
    ({"output_config": {"effort": "medium"}}, "high"),
])
def test_messages_budget_selects_effort_and_explicit_effort_wins(cores, extra, level):
    r, prompt = call(cores["kimi3"], "messages", extra)
    assert r.status_code == 200, r.text
    assert effort_of(prompt) == level
    # count_tokens renders the same prompt
    count, _ = call(cores["kimi3"], "count", extra)
    assert count.json()["input_tokens"] == r.json()["usage"]["input_tokens"] == len(prompt_ids(cores["kimi3"], prompt))


def prompt_ids(core, text: str) -> list[int]:
    manifest = read_manifest(core)
    return Tokenizer.from_file(core / manifest.tokenizer.file, manifest.tokenizer,
                               manifest.arch.vocab_size).encode(text, add_special_tokens=False)


def test_deepseek41_takes_integer_scores_at_top_level_or_in_chat_template_kwargs(cores):
    core = cores["deepseek41"]
    assert rendered(core, "chat", {"reasoning_effort": 80}) == "80"
    assert rendered(core, "chat", {"chat_template_kwargs": {"reasoning_effort": 1}}) == "1"
    assert rendered(core, "chat", {"reasoning_effort": 100}) == "100"
    assert rendered(core, "chat", {}) == "75"  # default high
    assert rendered(core, "chat", {"reasoning_effort": None}) == "75"  # explicit null: the high default
    assert rendered(core, "chat", {"reasoning_effort": "low"}) == "50"
    assert rendered(core, "responses", {"reasoning": {"effort": "xhigh"}}) == "75"
    assert rendered(core, "messages", {"output_config": {"effort": "max"}}) == "100"


def _openai_error(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


@pytest.mark.parametrize("extra,param,needle", [
    ({"reasoning_effort": 0}, "reasoning_effort", "1 through 100"),
    ({"reasoning_effort": 101}, "reasoning_effort", "1 through 100"),
    ({"reasoning_effort": 80.0}, "reasoning_effort", "JSON integer"),
    ({"reasoning_effort": True}, "reasoning_effort", "JSON integer"),
    ({"reasoning_effort": "80"}, "reasoning_effort", "not the string"),
    ({"reasoning_effort": "ultra"}, "reasoning_effort", "must be one of"),
    ({"chat_template_kwargs": {"reasoning_effort": 80.0}}, "chat_template_kwargs", "JSON integer"),
    ({"chat_template_kwargs": {"reasoning_effort": "80"}}, "chat_template_kwargs", "not the string"),
    ({"chat_template_kwargs": {"reasoning_effort": 0}}, "chat_template_kwargs", "1 through 100"),
])
def test_deepseek41_chat_rejections(cores, extra, param, needle):
    r, prompt = call(cores["deepseek41"], "chat", extra)
    assert needle in _openai_error(r, param) and prompt is None


@pytest.mark.parametrize("recipe", ["deepseek4", "qwen38", "qwen3"])
def test_numeric_effort_needs_a_declared_score_range(cores, recipe):
    for extra in ({"reasoning_effort": 80}, {"chat_template_kwargs": {"reasoning_effort": 80}}):
        r, _ = call(cores[recipe], "chat", extra)
        if recipe == "qwen3" and "chat_template_kwargs" in extra:
            assert r.status_code == 200  # no vocabulary: chat_template_kwargs are the template's own business
            continue
        assert "no numeric effort" in _openai_error(r, next(iter(extra)))


def test_responses_and_messages_never_take_numbers_even_with_a_score_range(cores):
    core = cores["deepseek41"]
    for effort in (80, 80.0, "ultra"):
        r, _ = call(core, "responses", {"reasoning": {"effort": effort}})
        assert "reasoning.effort" in _openai_error(r, "reasoning")
        r, _ = call(core, "messages", {"output_config": {"effort": effort}})
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "output_config.effort" in body["error"]["message"]


def test_without_a_vocabulary_named_effort_is_accepted_and_ignored(cores):
    core = cores["qwen3"]
    assert read_manifest(core).recipe.effort_levels == []
    assert rendered(core, "chat", {"reasoning_effort": "high"}) == "unset"
    assert rendered(core, "responses", {"reasoning": {"effort": "minimal"}}) == "unset"
    assert rendered(core, "messages", {"output_config": {"effort": "max"},
                                       "thinking": {"type": "enabled", "budget_tokens": 30000}}) == "unset"
    # explicit template kwargs still reach the template verbatim
    assert rendered(core, "chat", {"chat_template_kwargs": {"reasoning_effort": "custom"}}) == "custom"
    r, _ = call(core, "chat", {"reasoning_effort": "ultra"})
    assert "must be one of" in _openai_error(r, "reasoning_effort")
