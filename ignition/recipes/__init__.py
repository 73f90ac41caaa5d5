"""Recipe registry and validation: name -> RecipeSpec, resolved into the manifest's Recipe and Sampling.

Owns the rules a recipe must satisfy (ranges contain defaults and valid sampler values) and how a
checkpoint's generation_config.json fills a from-generation-config recipe. The values live in table.py.
Imports helios.core.manifest and ignition.errors only.
"""

from __future__ import annotations

import math
import re
from functools import cache
from typing import Any

import msgspec

from helios.core.manifest import Range, Recipe, Sampling, SamplingDefaults, SamplingRanges
from ignition.errors import ExportError
from ignition.recipes.table import ALL_RECIPES, DISABLED, RecipeSpec

__all__ = ["RecipeSpec", "auto_recipe", "get_recipe", "list_recipes", "resolve", "validate"]

TOOL_PARSERS = frozenset({"qwen_xml", "hermes", "glm", "dsml", "dsml_v4", "dsml_v41", "gemma4", "minimax", "mimo",
                          "kimi", "step", "xtml"})
REASONING_PARSERS = frozenset({"think", "glm", "dsml", "gemma4", "minimax", "xtml"})
# generation_config.json keys that override a from-generation-config recipe's defaults (vLLM reads the
# same set). NOTE: do_sample is ignored: do_sample=false is mostly a library default, and the sampling
# fields the author wrote still describe the intended distribution.
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
PENALTY_BOUND = 2.0  # |presence| and |frequency| penalties, OpenAI's interval


@cache
def _registry() -> dict[str, RecipeSpec]:
    out: dict[str, RecipeSpec] = {}
    for spec in ALL_RECIPES:
        if spec.name in out:
            raise ExportError(f"recipe {spec.name!r} is declared twice")
        validate(spec)
        out[spec.name] = spec
    return out


def list_recipes() -> list[str]:
    """Every recipe name, table order (author recipes, then the families we run now)."""
    return list(_registry())


def get_recipe(name: str) -> RecipeSpec:
    try:
        return _registry()[name]
    except KeyError:
        raise ExportError(f"unknown recipe {name!r}; known: {', '.join(list_recipes())}") from None


# Families only the spec's recipe rows use: the row's recipe binds by default (docs/families.md maps them).
_FAMILY_RECIPES = {
    "qwen4_exp": "qwen38",
    "glm5_next": "glm53",
    "nemotron_h": "nemotron_h",
    "mimo_v2_flash": "mimo_v2",
    "minimax_m3": "minimax_m3",
    "muse_spark": "muse_spark",
    "gemma4": "gemma4",
    "step3p7": "step5",
}


def auto_recipe(family: str, identifier: str) -> str:
    """The recipe used when --recipe is omitted, from the checkpoint's family and identifier (id or file name)."""
    ident = identifier.lower()
    if family == "llama" and "smollm" in ident:
        return "smollm2"
    if family == "qwen2" and ("coder" in ident or "instruct" in ident):
        return "qwen25"
    if family in ("qwen3", "qwen3_moe"):
        return "qwen3"
    if family == "gemma3":
        return "gemma3"
    if family in ("qwen3_5", "qwen3_5_moe", "qwen3_next"):  # the table's Qwen3.8-27B; Qwen3.5 is not a row
        return "qwen38_dense" if re.search(r"qwen3[._-]?8", ident) else "default"
    if family == "deepseek_v4":  # V4.1 ships in the same family (its config says so)
        return "deepseek41" if re.search(r"v4[._-]1", ident) else "deepseek4"
    return _FAMILY_RECIPES.get(family, "default")


def resolve(name: str, generation_config: dict, sampling_ranges: bool = True) -> tuple[Recipe, Sampling]:
    """The manifest's Recipe and Sampling for a recipe and a checkpoint's generation_config.json.

    Author recipes ignore generation_config (the table is the source). From-generation-config recipes take
    GENERATION_CONFIG_KEYS from it (top_k 0 means disabled, stored -1); each range widens to include its
    default. sampling_ranges=False (--no-sampling-ranges) drops every range: parameters fixed at defaults.
    """
    spec = get_recipe(name)
    if spec.from_generation_config:
        defaults = _apply_generation_config(spec.defaults, generation_config or {})
        ranges = _widen(spec.ranges, defaults)
        spec = msgspec.structs.replace(spec, defaults=defaults, ranges=ranges)
        try:
            validate(spec)
        except ExportError as e:
            raise ExportError(f"generation_config.json gives an unusable sampling default: {e}") from None
    recipe = Recipe(
        name=spec.name,
        tool_parser=spec.tool_parser,
        reasoning_parser=spec.reasoning_parser,
        effort_levels=list(spec.effort_levels),
        default_effort=spec.default_effort,
        effort_score_min=spec.effort_score_range[0] if spec.effort_score_range else None,
        effort_score_max=spec.effort_score_range[1] if spec.effort_score_range else None,
        effort_scores=dict(spec.effort_scores),
    )
    ranges = spec.ranges if sampling_ranges else SamplingRanges()
    return recipe, Sampling(defaults=spec.defaults, ranges=ranges)


def _apply_generation_config(defaults: SamplingDefaults, config: dict) -> SamplingDefaults:
    updates: dict[str, Any] = {}
    for key in GENERATION_CONFIG_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ExportError(f"generation_config.json {key} must be a number, got {value!r}")
        if key == "top_k":
            if value != int(value):
                raise ExportError(f"generation_config.json top_k must be an integer, got {value!r}")
            value = int(value)
            value = DISABLED if value <= 0 else value  # HF: 0 disables top-k
        else:
            value = float(value)
        updates[key] = value
    return msgspec.structs.replace(defaults, **updates)


def _widen(ranges: SamplingRanges, defaults: SamplingDefaults) -> SamplingRanges:
    updates = {}
    for field in msgspec.structs.fields(SamplingRanges):
        bound = getattr(ranges, field.name)
        value = getattr(defaults, field.name)
        if bound is not None and not bound.min <= value <= bound.max:
            updates[field.name] = Range(min=float(min(bound.min, value)), max=float(max(bound.max, value)))
    return msgspec.structs.replace(ranges, **updates) if updates else ranges


# --- validation -------------------------------------------------------------------------------------------


def _check_value(param: str, value: float) -> str | None:
    """Why `value` is not a valid sampler value for `param`, or None."""
    if not math.isfinite(value):
        return "must be finite"
    if param == "temperature" and value <= 0:
        return "must be > 0"
    if param == "top_p" and not 0 < value <= 1:
        return "must be in (0, 1]"
    if param == "top_k" and (value != int(value) or value < DISABLED or value == 0):
        return "must be an integer >= 1, or -1 (disabled)"
    if param == "min_p" and not 0 <= value <= 1:
        return "must be in [0, 1]"
    if param == "repetition_penalty" and value <= 0:
        return "must be > 0"
    if param in ("presence_penalty", "frequency_penalty") and not -PENALTY_BOUND <= value <= PENALTY_BOUND:
        return f"must be in [-{PENALTY_BOUND:g}, {PENALTY_BOUND:g}]"
    return None


def _check_bound(param: str, value: float) -> str | None:
    # A top_k range may include 0 (between -1 and a positive max); requests sending 0 mean "disabled".
    if param == "top_k":
        if not math.isfinite(value) or value != int(value) or value < DISABLED:
            return "must be an integer >= -1"
        return None
    return _check_value(param, value)


def validate(spec: RecipeSpec) -> None:
    """Raise ExportError naming the first rule `spec` breaks."""
    where = f"recipe {spec.name!r}"
    for field in msgspec.structs.fields(SamplingRanges):
        param = field.name
        default = getattr(spec.defaults, param)
        if why := _check_value(param, default):
            raise ExportError(f"{where}: default {param}={default!r} {why}")
        bound = getattr(spec.ranges, param)
        if bound is None:
            continue
        for side in ("min", "max"):
            if why := _check_bound(param, getattr(bound, side)):
                raise ExportError(f"{where}: {param} range {side}={getattr(bound, side)!r} {why}")
        if bound.min > bound.max:
            raise ExportError(f"{where}: {param} range [{bound.min}, {bound.max}] is empty")
        if not bound.min <= default <= bound.max:
            raise ExportError(f"{where}: {param} range [{bound.min}, {bound.max}] excludes its default {default}")
    if spec.defaults.seed < 0:
        raise ExportError(f"{where}: default seed must be >= 0")
    if spec.tool_parser is not None and spec.tool_parser not in TOOL_PARSERS:
        raise ExportError(f"{where}: unknown tool parser {spec.tool_parser!r}")
    if spec.reasoning_parser is not None and spec.reasoning_parser not in REASONING_PARSERS:
        raise ExportError(f"{where}: unknown reasoning parser {spec.reasoning_parser!r}")
    if len(set(spec.effort_levels)) != len(spec.effort_levels):
        raise ExportError(f"{where}: duplicate effort levels {list(spec.effort_levels)}")
    if spec.default_effort is not None and spec.default_effort not in spec.effort_levels:
        raise ExportError(f"{where}: default effort {spec.default_effort!r} is not one of its levels")
    if unknown := set(spec.effort_scores) - set(spec.effort_levels):
        raise ExportError(f"{where}: effort scores for unknown levels {sorted(unknown)}")
    if spec.effort_score_range is not None:
        lo, hi = spec.effort_score_range
        if not 1 <= lo <= hi:
            raise ExportError(f"{where}: effort score range {spec.effort_score_range} is invalid")
        if bad := {k: v for k, v in spec.effort_scores.items() if not lo <= v <= hi}:
            raise ExportError(f"{where}: effort scores {bad} fall outside {spec.effort_score_range}")
