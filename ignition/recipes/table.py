"""The recipe table as data: the spec's author recipes and the recipes of the families we run now.

Owns the values only (one RecipeSpec per recipe); validation and lookup live in ignition/recipes/__init__.py.
Imports helios.core.manifest for the Structs it fills, nothing else.

Parser names are keys the output parsers (helios/output) register under:
  tool:      qwen_xml (Qwen function tags), glm, dsml (DeepSeek DSML), xtml (Kimi K3's tools channel),
             gemma4, minimax, mimo, kimi (Kimi K2 tool-call section tokens), step (Step tool tags),
             hermes (<tool_call>{json}</tool_call>: Qwen2.5/Qwen3, Nemotron-H, Muse Spark)
  reasoning: think (<think>...</think>), glm (think tags, answer when none opened), dsml (DeepSeek's own
             encoder/parser), gemma4 (<|channel>thought ... <channel|>), minimax (<mm:think>...</mm:think>),
             xtml (Kimi K3's think / response channels)
"""

from __future__ import annotations

import msgspec

from helios.core.manifest import Range, SamplingDefaults, SamplingRanges

DISABLED = -1  # top_k stored for "no top-k filter"; Step 5's recommended 0 means the same


class RecipeSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One recipe: sampling defaults + declared intervals, parsers, effort vocabulary, provenance."""

    name: str
    basis: str  # the model card / source the values come from
    defaults: SamplingDefaults = SamplingDefaults()
    ranges: SamplingRanges = SamplingRanges()  # an absent range fixes the parameter at its default
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    effort_levels: tuple[str, ...] = ()  # named levels the prepared template / encoder accepts
    default_effort: str | None = None  # the level used when a request names none (None: template default)
    # DeepSeek V4.1: numeric reasoning_effort accepted in [lo, hi], and the score each named level maps to
    effort_score_range: tuple[int, int] | None = None
    effort_scores: dict[str, int] = {}
    # True: defaults are a fallback; generation_config.json's sampling fields override them (see resolve)
    from_generation_config: bool = False


def _author(name: str, basis: str, temperature: float, top_p: float, top_k: int, **fields) -> RecipeSpec:
    # NOTE: every author recipe defaults min_p=0, repetition_penalty=1, presence/frequency 0 (spec).
    defaults = SamplingDefaults(temperature=temperature, top_p=top_p, top_k=top_k)
    return RecipeSpec(name=name, basis=basis, defaults=defaults, **fields)


_QWEN38_RANGES = SamplingRanges(
    temperature=Range(min=0.7, max=1.0),
    top_p=Range(min=0.8, max=0.95),
    presence_penalty=Range(min=0.0, max=2.0),
)
_QWEN = dict(tool_parser="qwen_xml", reasoning_parser="think", effort_levels=("low", "medium", "xhigh"))
_DEEPSEEK = dict(
    tool_parser="dsml",
    reasoning_parser="dsml",
    effort_levels=("low", "high", "xhigh", "max"),
    default_effort="high",
)

# The spec's table ("Reasoning, sampling, and usage"), in its order.
AUTHOR_RECIPES: tuple[RecipeSpec, ...] = (
    _author("qwen38", "Qwen3.8-Flash-Next thinking/instruct presets", 1.0, 0.95, 20,
            ranges=_QWEN38_RANGES, **_QWEN),
    _author("qwen38_dense", "Qwen3.8-27B thinking/instruct presets", 1.0, 0.95, 20,
            ranges=_QWEN38_RANGES, **_QWEN),
    _author("glm53", "GLM-5.3-Flash evaluation presets", 1.0, 0.95, DISABLED,
            ranges=SamplingRanges(temperature=Range(min=0.95, max=1.0), top_p=Range(min=0.95, max=1.0)),
            tool_parser="glm", reasoning_parser="glm"),
    _author("deepseek4", "DeepSeek-V4-Flash-Vision-Exp agent evaluations", 1.0, 0.95, DISABLED, **_DEEPSEEK),
    # NOTE: the one range not from the card: repetition penalty from measured use (spec).
    _author("deepseek41", "DeepSeek-V4.1-Flash-1017 recommendations", 1.0, 1.0, DISABLED,
            ranges=SamplingRanges(repetition_penalty=Range(min=1.0, max=1.1)),
            effort_score_range=(1, 100), effort_scores={"low": 50, "high": 75, "xhigh": 75, "max": 100},
            **_DEEPSEEK),
    _author("mimo_v2", "MiMo-V2.6-Pro-MOPD deployment; MiMo-V2.6-Flash-RL deployment", 1.0, 0.95, DISABLED,
            tool_parser="mimo", reasoning_parser="think"),
    # Kimi K3 always thinks; low/high/max effort, default max (spec). XTML: helios/core/kimi_encoding.py.
    _author("kimi3", "Kimi-K3 single-step/agentic evaluations", 1.0, 1.0, DISABLED,
            ranges=SamplingRanges(top_p=Range(min=0.95, max=1.0)),
            tool_parser="xtml", reasoning_parser="xtml",
            effort_levels=("low", "high", "max"), default_effort="max"),
    # Step 5's card recommends top_k 0, which means disabled.
    _author("step5", "Step-5-Preview-NVFP4 inference recommendations", 1.0, 0.95, DISABLED,
            tool_parser="step", reasoning_parser="think"),
    _author("nemotron_h", "Nemotron-3.5-Bolt text recommendations", 1.0, 0.95, DISABLED,
            tool_parser="hermes", reasoning_parser="think"),
    _author("kimi31", "Kimi-K3.1-Pro evaluation settings", 1.0, 0.95, DISABLED,
            tool_parser="xtml", reasoning_parser="xtml"),
    _author("minimax_m3", "MiniMax-M3.1-Flash usage recommendations", 1.0, 0.95, DISABLED,
            tool_parser="minimax", reasoning_parser="minimax"),
    _author("muse_spark", "Muse-Spark-Open-816B-A42B-NVFP4 model card", 1.0, 1.0, DISABLED,
            tool_parser="hermes", reasoning_parser="think"),
    _author("gemma4", "Gemma 4 model card sampling recommendations", 1.0, 0.95, 64,
            tool_parser="gemma4", reasoning_parser="gemma4"),
)  # fmt: skip

# Intervals of the from-generation-config recipes: no author table exists, so these are wide, sane bounds.
# resolve() widens a bound to include a checkpoint default that falls outside it.
GENERIC_RANGES = SamplingRanges(
    temperature=Range(min=0.05, max=2.0),
    top_p=Range(min=0.05, max=1.0),
    top_k=Range(min=-1.0, max=1000.0),
    min_p=Range(min=0.0, max=1.0),
    repetition_penalty=Range(min=1.0, max=2.0),
    presence_penalty=Range(min=-2.0, max=2.0),
    frequency_penalty=Range(min=-2.0, max=2.0),
)


def _checkpoint(name: str, basis: str, defaults: SamplingDefaults, **fields) -> RecipeSpec:
    return RecipeSpec(
        name=name, basis=basis, defaults=defaults, ranges=GENERIC_RANGES, from_generation_config=True, **fields
    )


# The families we run now; their defaults are the fallback when generation_config.json omits a field.
CHECKPOINT_RECIPES: tuple[RecipeSpec, ...] = (
    _checkpoint("smollm2", "SmolLM2-Instruct generation_config.json (no sampling fields)", SamplingDefaults()),
    _checkpoint(
        "qwen25",
        "Qwen2.5(-Coder)-Instruct generation_config.json",
        SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05),
        tool_parser="hermes",
    ),
    _checkpoint(
        "qwen3",
        "Qwen3 generation_config.json (thinking-mode preset)",
        SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20),
        tool_parser="hermes",
        reasoning_parser="think",
    ),
    _checkpoint("gemma3", "Gemma 3 generation_config.json", SamplingDefaults(top_k=64, top_p=0.95)),
    _checkpoint("default", "generation_config.json, else neutral sampling", SamplingDefaults()),
)

ALL_RECIPES: tuple[RecipeSpec, ...] = AUTHOR_RECIPES + CHECKPOINT_RECIPES
