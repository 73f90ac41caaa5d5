"""thinking_token_budget on the conversational routes: validation and resolution into the engine's budget.

Owns the request-side rules of the hard reasoning cap (spec "Reasoning, sampling, and usage"): an explicit
budget is a positive 32-bit integer on a core with single-token reasoning syntax (else HTTP 400 naming it);
an omitted one takes `[server] thinking_token_budget`; the engine gets a ReasoningBudget only when the
prompt leaves output inside reasoning. The cut itself is the engine's (helios/engine/reasoning_budget.py).
No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

from helios.core.manifest import ReasoningSyntax
from helios.engine.messages import ReasoningBudget
from helios.server.config import INT32_MAX
from helios.server.errors import bad_request
from helios.server.runtime import Runtime

if TYPE_CHECKING:
    from helios.server.tools import ToolPlan


def check_thinking_token_budget(runtime: Runtime, budget: int | None, param: str | None = "thinking_token_budget"):
    """An explicit budget must be a positive 32-bit integer, on a core with single-token reasoning syntax."""
    if budget is None:
        return
    if not 1 <= budget <= INT32_MAX:
        raise bad_request("thinking_token_budget must be a positive 32-bit integer", param)
    reasoning = runtime.manifest.template.reasoning
    if reasoning is None or reasoning.close_token_id is None:
        raise bad_request("thinking_token_budget needs a core with single-token reasoning syntax; this core has none",
                          param)


def reasoning_budget(runtime: Runtime, explicit: int | None, prompt_ids: list[int],
                     plan: ToolPlan | None = None) -> ReasoningBudget | None:
    """The engine's budget for one request; None leaves reasoning uncapped.

    `explicit` is the request's validated budget (Messages: thinking.budget_tokens too), None when omitted:
    then the server default applies. A budget above the 32-bit output limit (Messages) can never be reached,
    so it caps nothing; a core without single-token reasoning syntax makes a Messages budget advisory.
    """
    budget = explicit if explicit is not None else runtime.serving.thinking_token_budget
    syntax = runtime.manifest.template.reasoning
    if budget is None or budget > INT32_MAX or syntax is None or syntax.close_token_id is None:
        return None
    return ReasoningBudget(
        max_reasoning_tokens=budget,
        close_token_id=syntax.close_token_id,
        starts_in_reasoning=output_starts_in_reasoning(syntax, prompt_ids),
        tool_open_token_ids=_tool_open_token_ids(runtime, plan),
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


def _tool_open_token_ids(runtime: Runtime, plan: ToolPlan | None) -> tuple[int, ...]:
    """Single-token tool openers that may end reasoning implicitly (Qwen, GLM), while tools are parsed."""
    name = runtime.manifest.recipe.tool_parser
    if not name:
        return ()
    from helios.output.parsers import make_tool_parser

    if not make_tool_parser(name).ends_reasoning:
        return ()  # calls are not recognized inside reasoning: an opener there is reasoning text
    return tool_open_token_ids(runtime, plan)


def tool_open_token_ids(runtime: Runtime, plan: ToolPlan | None) -> tuple[int, ...]:
    """The single-token openers of the core's tool-call syntax, while this request's tools are parsed."""
    name = runtime.manifest.recipe.tool_parser
    if plan is None or not plan.parses_tools or not name:
        return ()
    from helios.output.parsers import make_tool_parser

    ids = [runtime.tokenizer.encode(marker, add_special_tokens=False) for marker in make_tool_parser(name).text_markers]
    return tuple(sorted({i[0] for i in ids if len(i) == 1}))
