"""The reasoning context of one request: thinking_token_budget's rules and where this prompt leaves the output.

Owns the request-side rules of the hard reasoning cap (spec "Reasoning, sampling, and usage"): an explicit
budget is a positive 32-bit integer on a core with single-token reasoning syntax (else InvalidRequest naming
it); an omitted one takes `[server] thinking_token_budget`; the engine gets a ReasoningBudget only when the
core can cut. Also the one rule of whether this prompt's output starts inside reasoning (the budget, the output
parsers and the output constraint read it) and the single-token tool openers that end reasoning. The cut itself
is the engine's (helios/engine/reasoning_budget.py). No torch; must not import the server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from helios.core.manifest import ReasoningSyntax
from helios.engine.messages import ReasoningBudget
from helios.frontend.sampling import InvalidRequest

if TYPE_CHECKING:
    from helios.frontend.context import ModelContext

INT32_MAX = 2**31 - 1  # the output-limit bound of every token count (spec: 32-bit integers)


def check_thinking_token_budget(ctx: ModelContext, budget: int | None,
                                param: str | None = "thinking_token_budget") -> None:
    """An explicit budget must be a positive 32-bit integer, on a core with single-token reasoning syntax."""
    if budget is None:
        return
    if not 1 <= budget <= INT32_MAX:
        raise InvalidRequest("thinking_token_budget must be a positive 32-bit integer", param)
    reasoning = ctx.manifest.template.reasoning
    if reasoning is None or reasoning.close_token_id is None:
        raise InvalidRequest("thinking_token_budget needs a core with single-token reasoning syntax; this core has "
                             "none", param)


def reasoning_budget(ctx: ModelContext, explicit: int | None, prompt_ids: list[int],
                     parses_tools: bool = False) -> ReasoningBudget | None:
    """The engine's budget for one request; None leaves reasoning uncapped.

    `explicit` is the request's validated budget (Messages: thinking.budget_tokens too), None when omitted:
    then the server default applies. A budget above the 32-bit output limit (Messages) can never be reached,
    so it caps nothing; a core without single-token reasoning syntax makes a Messages budget advisory.
    """
    budget = explicit if explicit is not None else ctx.limits.thinking_token_budget
    syntax = ctx.manifest.template.reasoning
    if budget is None or budget > INT32_MAX or syntax is None or syntax.close_token_id is None:
        return None
    return ReasoningBudget(
        max_reasoning_tokens=budget,
        close_token_id=syntax.close_token_id,
        starts_in_reasoning=output_starts_in_reasoning(syntax, prompt_ids),
        tool_open_token_ids=_tool_open_token_ids(ctx, parses_tools),
    )


def request_syntax(syntax: ReasoningSyntax, prompt_ids: list[int]) -> ReasoningSyntax:
    """The core's reasoning syntax with starts_in_reasoning decided for this prompt (the output parsers')."""
    return msgspec.structs.replace(syntax, starts_in_reasoning=output_starts_in_reasoning(syntax, prompt_ids))


def output_starts_in_reasoning(syntax: ReasoningSyntax, prompt_ids: list[int]) -> bool:
    """This request's output starts inside reasoning: the template's generation prompt opens it (the probe)
    and this prompt's last reasoning delimiter is the open one. One rule for the budget and the output parser.

    NOTE: the probe describes the default rendering; a request can render otherwise (Qwen's
    enable_thinking=false closes the empty reasoning in the prompt, an assistant prefill continues its
    answer), so the ids decide per request. A text-matched opener has no id: the probe decides alone.
    """
    if not syntax.starts_in_reasoning:
        return False
    if syntax.open_token_id is None:
        return True
    for token_id in reversed(prompt_ids):
        if token_id == syntax.open_token_id:
            return True
        if token_id == syntax.close_token_id:
            return False
    return False


def _tool_open_token_ids(ctx: ModelContext, parses_tools: bool) -> tuple[int, ...]:
    """Single-token tool openers that may end reasoning implicitly (Qwen, GLM), while tools are parsed."""
    name = ctx.manifest.recipe.tool_parser
    if not name:
        return ()
    from helios.output.parsers import make_tool_parser

    if not make_tool_parser(name).ends_reasoning:
        return ()  # calls are not recognized inside reasoning: an opener there is reasoning text
    return tool_open_token_ids(ctx, parses_tools)


def tool_open_token_ids(ctx: ModelContext, parses_tools: bool) -> tuple[int, ...]:
    """The single-token openers of the core's tool-call syntax, while this request's tools are parsed."""
    name = ctx.manifest.recipe.tool_parser
    if not parses_tools or not name:
        return ()
    from helios.output.parsers import make_tool_parser

    ids = [ctx.tokenizer.encode(marker, add_special_tokens=False) for marker in make_tool_parser(name).text_markers]
    return tuple(sorted({i[0] for i in ids if len(i) == 1}))
