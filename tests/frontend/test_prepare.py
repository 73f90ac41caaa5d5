"""frontend.prepare, the one request preparation: conversations and raw prompts -> choices, on a tiny model context."""

from __future__ import annotations

import pytest

from helios.core.manifest import TemplateCaps
from helios.frontend.chat import ChatMessage
from helios.frontend.context import ModelContext, ModelLimits
from helios.frontend.prepare import Conversation, GenerationRequest, prepare, render
from helios.frontend.sampling import InvalidRequest, SamplingFields
from helios.frontend.structured import native_structured_outputs
from helios.frontend.tools import FunctionTool, ToolPlan
from tests.frontend.conftest import byte_level_tok, make_manifest, tokenizer  # noqa: F401 (fixtures)

TEMPLATE = ("{% for t in tools or [] %}tool: {{ t | tojson }}\n{% endfor %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


@pytest.fixture
def ctx(tokenizer) -> ModelContext:
    manifest = make_manifest(tokenizer=tokenizer.info, template=TemplateCaps(present=True, file="t.jinja", tools=True))
    return ModelContext.build(manifest, ModelLimits(max_model_len=128, default_max_tokens=16), tokenizer, TEMPLATE)


def _chat(text: str = "hello world", **kw) -> Conversation:
    return Conversation([ChatMessage(role="user", content=text)], **kw)


def test_a_conversation_gives_n_choices_with_their_own_seeds(ctx):
    req = GenerationRequest(_chat(), SamplingFields(seed=7, stop=["x"]), max_tokens=3, n=3)
    prep = prepare(ctx, req, "chatcmpl-1")
    assert ctx.tokenizer.decode(prep.prompt_ids) == prep.prompt_text == "user: hello world\nassistant:"
    assert [c.index for c in prep.choices] == [0, 1, 2]
    assert [c.request.req_id for c in prep.choices] == ["chatcmpl-1-0", "chatcmpl-1-1", "chatcmpl-1-2"]
    assert [c.request.sampling.seed for c in prep.choices] == [7, 8, 9]
    assert all(c.request.sampling.max_tokens == 3 and c.request.prompt_token_ids == prep.prompt_ids
               for c in prep.choices)
    assert prep.choices[0].output_spec is None  # the test recipe parses nothing: the text-only path


def test_raw_prompts_index_choices_by_prompt_and_skip_zero_token_choices(ctx):
    prompts = [[5, 6], [7, 8, 9]]
    prep = prepare(ctx, GenerationRequest(prompts, SamplingFields(), max_tokens=2, n=2), "cmpl-1")
    assert [(c.index, c.request.prompt_token_ids) for c in prep.choices] == [
        (0, [5, 6]), (1, [5, 6]), (2, [7, 8, 9]), (3, [7, 8, 9])]
    assert prep.prompt_text is None
    echo_only = GenerationRequest(prompts, SamplingFields(), max_tokens=0, allow_zero_tokens=True,
                                  submit_zero_tokens=False)
    assert prepare(ctx, echo_only, "cmpl-2").choices == []
    with pytest.raises(InvalidRequest, match="max_tokens must be a positive integer"):
        prepare(ctx, GenerationRequest(prompts, SamplingFields(), max_tokens=0), "cmpl-3")


def test_control_ids_reach_every_route_and_the_budget_names_the_protocol_field(ctx):
    bos = ctx.manifest.tokenizer.bos_token_id
    assert bos in ctx.control_ids
    raw = prepare(ctx, GenerationRequest([[5]], SamplingFields(), max_tokens=1), "cmpl-1").choices[0]
    conv = prepare(ctx, GenerationRequest(_chat(), SamplingFields(), max_tokens=1), "chat-1").choices[0]
    assert raw.processor._no_parser_text == conv.processor._no_parser_text  # one pipeline for both
    req = GenerationRequest(_chat(), SamplingFields(), max_tokens=0, max_tokens_param="max_output_tokens")
    with pytest.raises(InvalidRequest) as info:
        prepare(ctx, req, "resp-1")
    assert (info.value.message, info.value.param) == ("max_output_tokens must be a positive integer",
                                                      "max_output_tokens")


def test_tools_and_format_rules_apply_before_rendering(ctx):
    plan = ToolPlan(tools=[FunctionTool(name="f", parameters={"type": "object"})], mode="required")
    prompt = render(ctx, GenerationRequest(_chat(), SamplingFields(), plan=plan))
    assert prompt.text.startswith('tool: {"type": "function", "function": {"name": "f", "parameters":')
    assert "system: You must respond by calling one or more of the provided tools." in prompt.text
    fmt = native_structured_outputs({"regex": "[ab]+"})
    with pytest.raises(InvalidRequest, match="cannot be combined with custom stops"):
        prepare(ctx, GenerationRequest(_chat(), SamplingFields(stop=["x"]), fmt=fmt), "chat-2")
    with pytest.raises(InvalidRequest, match="assistant continuation"):
        render(ctx, GenerationRequest(_chat(continue_final_message=True), SamplingFields(), fmt=fmt))
