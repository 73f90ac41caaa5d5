"""The one request preparation every generating route shares: neutral request in, engine requests out.

A protocol decodes its own JSON into a `GenerationRequest` (a conversation or a raw prompt, SamplingFields,
the validated ToolPlan, the output format, the reasoning budget) and calls `prepare`, which applies the rules
in one order: output-format combination, grammar compilation, template rendering and tokenization, the output
budget, sampling resolution, the reasoning budget, the output constraint and each choice's output processor.
Refusals are InvalidRequest; the protocol turns them into its error shape. No torch; must not import the
server.
"""

from __future__ import annotations

import dataclasses

import msgspec
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from helios.engine.messages import EngineRequest
from helios.frontend.boundaries import message_boundaries
from helios.frontend.chat import ChatMessage, ChatPrompt
from helios.frontend.context import ModelContext
from helios.frontend.reasoning import reasoning_budget
from helios.frontend.sampling import SamplingFields, resolve_max_tokens, resolve_sampling
from helios.frontend.structured import (OutputFormat, check_combination, compile_format, output_constraint,
                                       with_format_instruction)
from helios.frontend.tools import ToolPlan, output_spec, with_instruction
from helios.output.choice import OutputSpec
from helios.output.processor import OutputProcessor


@dataclass
class Conversation:
    """A chat to render with the core's template."""

    messages: list[ChatMessage]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: dict[str, Any] | None = None


@dataclass
class GenerationRequest:
    """One protocol request, decoded: what to generate from and how. `prompt` is a Conversation or raw
    prompts' token ids (Completions: no template, no tools, no reasoning envelope; `n` choices each)."""

    prompt: Conversation | list[list[int]]
    fields: SamplingFields
    max_tokens: int | None = None  # the requested output budget (None: the server default)
    max_tokens_param: str = "max_tokens"  # how the protocol spells the output budget (error texts)
    allow_zero_tokens: bool = False  # Completions: max_tokens 0 scores or echoes the prompt alone
    submit_zero_tokens: bool = True  # False: a max_tokens-0 choice is not submitted (nothing to score)
    n: int = 1
    plan: ToolPlan | None = None
    fmt: OutputFormat | None = None  # structured output
    thinking_budget: int | None = None  # the request's explicit reasoning cap, validated
    skip_special_tokens: bool = True
    new_call_id: Callable[[], str] | None = None  # the protocol's tool-call id spelling

    @property
    def conversation(self) -> Conversation | None:
        return self.prompt if isinstance(self.prompt, Conversation) else None


@dataclass
class Choice:
    """One prepared choice: its engine request and its output pipeline."""

    index: int
    request: EngineRequest
    processor: OutputProcessor
    output_spec: OutputSpec | None = None


@dataclass
class Prepared:
    prompt_ids: list[int]  # the conversation's (the first raw prompt's)
    prompt_text: str | None = None  # the rendered conversation (None for raw prompts)
    choices: list[Choice] = field(default_factory=list)


def render(ctx: ModelContext, req: GenerationRequest) -> ChatPrompt:
    """The conversation's prompt alone, under the same rules (count_tokens: no grammar, no sampling)."""
    _check_format(req)
    return _render(ctx, req.conversation, req)


def prepare(ctx: ModelContext, req: GenerationRequest, req_id: str) -> Prepared:
    """Validate, render and tokenize, then build `n` choices per prompt (index i * n + j, req id
    `{req_id}-{index}`)."""
    _check_format(req)
    # NOTE: compiled before rendering: a bad grammar is refused first on every route, and once per request
    grammar = compile_format(ctx, req.fmt) if req.fmt is not None else None
    conv = req.conversation
    marks = (0, [])
    if conv is not None:
        prompt = _render(ctx, conv, req)
        prepared, prompts = Prepared(prompt.token_ids, prompt.text), [prompt.token_ids]
        if ctx.manifest.arch.recurrent is not None:  # a hybrid model's checkpoint positions (anchor, messages)
            marks = _boundaries(ctx, conv, req, prompt)
    else:
        prepared, prompts = Prepared(req.prompt[0] if req.prompt else []), req.prompt
    for i, ids in enumerate(prompts):
        prepared.choices += _choices(ctx, req, ids, i * req.n, f"{req_id}-", grammar, marks)
    return prepared


def with_cache_hints(ctx: ModelContext, choice: Choice, positions: list[int]) -> Choice:
    """The choice with the client's cache hints (Anthropic cache_control block ends, as prompt token positions) among
    its message candidates, for a hybrid model's state checkpoints: advisory, chosen by the same cost rule and never
    above the anchor; an attention-only model's page reuse needs none."""
    if not positions or ctx.manifest.arch.recurrent is None:
        return choice
    ends = sorted({*choice.request.message_ends, *positions})
    return dataclasses.replace(choice, request=msgspec.structs.replace(choice.request, message_ends=ends))


def _check_format(req: GenerationRequest) -> None:
    conv = req.conversation
    check_combination(req.fmt, has_stops=req.fields.has_stops, ignore_eos=req.fields.ignore_eos,
                      continuation=conv is not None and conv.continue_final_message)


def _render(ctx: ModelContext, conv: Conversation, req: GenerationRequest) -> ChatPrompt:
    """Tools, required mode's instruction and the JSON-only instruction, rendered and tokenized."""
    messages = with_format_instruction(with_instruction(conv.messages, req.plan), req.fmt)
    plan = req.plan or ToolPlan()
    return ctx.chat.render(messages, tools=plan.presented, add_generation_prompt=conv.add_generation_prompt,
                           continue_final_message=conv.continue_final_message, template_kwargs=conv.template_kwargs)


def _boundaries(ctx: ModelContext, conv: Conversation, req: GenerationRequest,
                prompt: ChatPrompt) -> tuple[int, list[int]]:
    """The rendered conversation's anchor and message ends (token offsets), under _render's messages and tools."""
    messages = with_format_instruction(with_instruction(conv.messages, req.plan), req.fmt)
    return message_boundaries(ctx.chat, messages, prompt, (req.plan or ToolPlan()).presented, conv.template_kwargs)


def _choices(ctx: ModelContext, req: GenerationRequest, ids: list[int], first: int, prefix: str,
             grammar: str | None, marks: tuple[int, list[int]] = (0, [])) -> list[Choice]:
    """One prompt's `n` choices: output budget, per-choice sampling (seed + j), reasoning budget, constraint,
    output processor and parser spec. A raw prompt has no reasoning or tool envelope: the grammar covers it all.
    marks: the conversation's (anchor_end, message_ends), for a hybrid model's state checkpoints."""
    limits, tok, conv = ctx.limits, ctx.tokenizer, req.conversation
    max_tokens = resolve_max_tokens(req.max_tokens, len(ids), limits.max_model_len, limits.default_max_tokens,
                                    allow_zero=req.allow_zero_tokens, param=req.max_tokens_param)
    budget, spec = None, None
    if conv is not None:
        budget = reasoning_budget(ctx, req.thinking_budget, ids, req.plan is not None and req.plan.parses_tools)
        spec = output_spec(ctx, req.plan, ids)
        if spec is not None and req.new_call_id is not None:
            spec = dataclasses.replace(spec, new_call_id=req.new_call_id)
    out = []
    for j in range(req.n):
        sampling = resolve_sampling(req.fields, ctx.manifest, max_tokens, seed_offset=j)
        if max_tokens == 0 and not req.submit_zero_tokens:
            continue  # tokenization and echo only: nothing to submit
        constraint = None
        if grammar is not None and max_tokens > 0:
            constraint = (output_constraint(ctx, grammar, ids, req.plan) if conv is not None
                          else output_constraint(ctx, grammar, None, None, conversational=False))
        request = EngineRequest(req_id=f"{prefix}{first + j}", prompt_token_ids=ids, sampling=sampling,
                                reasoning_budget=budget, constraint=constraint, anchor_end=marks[0],
                                message_ends=marks[1])
        # NOTE: every route passes the control ids; they only hide BOS/PAD/UNK text from the output parsers
        processor = OutputProcessor(tok.token_bytes, tok.special_ids, sampling, req.fields.stop,
                                    req.skip_special_tokens, ctx.control_ids)
        out.append(Choice(first + j, request, processor, spec))
    return out
