"""Reasoning effort: protocol values -> one neutral level -> the value the core's template accepts.

Owns the request-side effort rules of the spec ("Reasoning, sampling, and usage"): the neutral scale, which
values each protocol accepts, the Messages budget -> effort rule, and the resolution against the effort
vocabulary the core's recipe declares (manifest `recipe.effort_levels`, `default_effort`, score range and
scores). The result reaches the template as the `reasoning_effort` variable. Imports the manifest and
InvalidRequest only; no torch.

Resolution (`resolve_effort`): a level the vocabulary holds is used as is; any other neutral level goes to
the vocabulary level nearest on NEUTRAL_LEVELS, a tie going to the higher one (so Qwen's low/medium/xhigh
turns high into xhigh and minimal into low; Kimi's low/high/max turns medium into high and xhigh into max).
On a core whose recipe scores its levels (DeepSeek V4.1) the template receives the level's integer score.
A request without effort gets the recipe's default_effort, or nothing (the template's own default).
A core without an effort vocabulary accepts named effort and ignores it, as vLLM does for models without one.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from helios.core.manifest import Recipe
from helios.frontend.sampling import InvalidRequest

# The neutral scale, lowest first: OpenAI's names (none .. xhigh) plus Anthropic's max. "none" is only a
# level here: it resolves to the lowest level the template has and does not switch reasoning off.
EffortLevel = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
NEUTRAL_LEVELS: tuple[EffortLevel, ...] = get_args(EffortLevel)
# The template variable the resolved effort is passed as: the name HF templates read (gpt-oss, and the
# native reasoning_effort option of DeepSeek V4.1). NOTE: the manifest has no field naming it per recipe.
EFFORT_VARIABLE = "reasoning_effort"
# Messages thinking.budget_tokens -> effort: up to 5,000 low, up to 20,000 high, larger max (spec).
LOW_BUDGET_MAX = 5_000
HIGH_BUDGET_MAX = 20_000

Effort = EffortLevel | int  # a neutral level, or a numeric score (only where the recipe declares a range)


def _named(value: Any, param: str | None, what: str) -> EffortLevel:
    if value not in NEUTRAL_LEVELS:
        raise InvalidRequest(f"{what} must be one of {', '.join(NEUTRAL_LEVELS)}; got {value!r}", param)
    return value


def named_effort(value: Any, param: str | None, what: str) -> EffortLevel | None:
    """Responses reasoning.effort and Messages output_config.effort: a named level or null, never a number."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{what} must be a named level ({', '.join(NEUTRAL_LEVELS)}), not a number", param)
    return _named(value, param, what)


def native_effort(value: Any, recipe: Recipe, param: str, what: str = "reasoning_effort") -> Effort | None:
    """Chat reasoning_effort (top level or in chat_template_kwargs): a named level, or a JSON integer within
    the recipe's score range. Floats (80.0), booleans and numeric strings ("80") are refused."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lstrip("+-").isdigit():
            raise InvalidRequest(f"{what} must be a named level or a JSON integer, not the string {value!r}", param)
        return _named(value, param, what)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"{what} must be a named level or a JSON integer; got {value!r}", param)
    lo, hi = recipe.effort_score_min, recipe.effort_score_max
    if lo is None or hi is None:
        raise InvalidRequest(f"{what} must be a named level; this model accepts no numeric effort", param)
    if not lo <= value <= hi:
        raise InvalidRequest(f"{what} must be an integer from {lo} through {hi}; got {value}", param)
    return value


def budget_effort(budget_tokens: int) -> EffortLevel:
    """The neutral level a Messages thinking budget selects."""
    if budget_tokens <= LOW_BUDGET_MAX:
        return "low"
    return "high" if budget_tokens <= HIGH_BUDGET_MAX else "max"


def messages_effort(output_effort: Any, thinking_type: str | None, budget_tokens: int | None) -> EffortLevel | None:
    """Messages: an explicit output_config.effort wins; else an enabled or adaptive thinking.budget_tokens
    selects one. thinking_token_budget alone does not (as on Chat and Responses, it is only a cap)."""
    effort = named_effort(output_effort, None, "output_config.effort")
    if effort is None and thinking_type in ("enabled", "adaptive") and budget_tokens is not None:
        effort = budget_effort(budget_tokens)
    return effort


def nearest_level(level: str, vocabulary: list[str]) -> str | None:
    """The vocabulary level for a neutral one: itself when held, else the nearest on the scale (ties go up).
    None when no vocabulary level is on the neutral scale."""
    if level in vocabulary:
        return level
    rank = NEUTRAL_LEVELS.index(level)
    scored = [(abs(NEUTRAL_LEVELS.index(v) - rank), -NEUTRAL_LEVELS.index(v), v) for v in vocabulary
              if v in NEUTRAL_LEVELS]
    return min(scored)[2] if scored else None


def resolve_effort(effort: Effort | None, recipe: Recipe) -> Effort | None:
    """The template's value for a validated request effort; None passes nothing (no vocabulary, or no
    request effort and no recipe default)."""
    if not recipe.effort_levels:
        return None
    if isinstance(effort, int):
        return effort  # native_effort already checked the recipe's range
    level = nearest_level(effort, recipe.effort_levels) if effort is not None else recipe.default_effort
    if level is None:
        return None
    return recipe.effort_scores.get(level, level)


def effort_template_kwargs(kwargs: dict[str, Any] | None, effort: Effort | None, recipe: Recipe,
                           param: str | None = "chat_template_kwargs") -> dict[str, Any]:
    """The render kwargs with the resolved effort set under EFFORT_VARIABLE.

    On a core with an effort vocabulary, a reasoning_effort inside chat_template_kwargs is the native option:
    it is checked like the top-level field and wins over `effort`. Without a vocabulary, the kwargs pass to
    the template verbatim and `effort` is ignored.
    """
    out = dict(kwargs or {})
    if not recipe.effort_levels:
        return out
    native = native_effort(out.pop(EFFORT_VARIABLE, None), recipe, param, f"chat_template_kwargs.{EFFORT_VARIABLE}")
    value = resolve_effort(native if native is not None else effort, recipe)
    if value is not None:
        out[EFFORT_VARIABLE] = value
    return out
