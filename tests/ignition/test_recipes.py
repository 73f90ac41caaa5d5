"""Recipes: the spec's table values exactly, validation rules, generation_config resolution, auto selection."""

from __future__ import annotations

import msgspec
import pytest

from helios.core.manifest import Range, Recipe, Sampling, SamplingDefaults, SamplingRanges
from ignition.errors import ExportError
from ignition.recipes import auto_recipe, get_recipe, list_recipes, resolve, validate

# The spec's table, typed in independently of ignition/recipes/table.py:
# name: (temperature, top_p, top_k, {param: (min, max)})
SPEC_TABLE = {
    "qwen38": (1, 0.95, 20, {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)}),
    "qwen38_dense": (1, 0.95, 20, {"temperature": (0.7, 1), "top_p": (0.8, 0.95), "presence_penalty": (0, 2)}),
    "glm53": (1, 0.95, -1, {"temperature": (0.95, 1), "top_p": (0.95, 1)}),
    "deepseek4": (1, 0.95, -1, {}),
    "deepseek41": (1, 1, -1, {"repetition_penalty": (1, 1.1)}),
    "mimo_v2": (1, 0.95, -1, {}),
    "kimi3": (1, 1, -1, {"top_p": (0.95, 1)}),
    "step5": (1, 0.95, -1, {}),
    "nemotron_h": (1, 0.95, -1, {}),
    "kimi31": (1, 0.95, -1, {}),
    "minimax_m3": (1, 0.95, -1, {}),
    "muse_spark": (1, 1, -1, {}),
    "gemma4": (1, 0.95, 64, {}),
}
RANGE_FIELDS = [f.name for f in msgspec.structs.fields(SamplingRanges)]


@pytest.mark.parametrize("name", list(SPEC_TABLE))
def test_author_recipe_matches_spec_table(name):
    temperature, top_p, top_k, intervals = SPEC_TABLE[name]
    recipe, sampling = resolve(name, {"temperature": 0.3, "top_k": 5})  # generation_config is ignored
    assert recipe.name == name
    d = sampling.defaults
    assert (d.temperature, d.top_p, d.top_k) == (temperature, top_p, top_k)
    assert (d.min_p, d.repetition_penalty, d.presence_penalty, d.frequency_penalty) == (0, 1, 0, 0)
    for field in RANGE_FIELDS:
        bound = getattr(sampling.ranges, field)
        if field in intervals:
            assert (bound.min, bound.max) == intervals[field], field
        else:
            assert bound is None, field


def test_table_order_and_names():
    names = list_recipes()
    assert names[: len(SPEC_TABLE)] == list(SPEC_TABLE)
    assert set(names[len(SPEC_TABLE) :]) == {"smollm2", "qwen25", "qwen3", "gemma3", "default"}


def test_parsers_and_effort_vocabulary():
    qwen = get_recipe("qwen38")
    assert (qwen.tool_parser, qwen.reasoning_parser) == ("qwen_xml", "think")
    assert qwen.effort_levels == ("low", "medium", "xhigh")
    assert resolve("qwen38", {})[0] == Recipe(
        name="qwen38", tool_parser="qwen_xml", reasoning_parser="think", effort_levels=["low", "medium", "xhigh"]
    )
    assert get_recipe("glm53").tool_parser == "glm"
    assert get_recipe("deepseek4").tool_parser == "dsml"
    assert get_recipe("gemma4").tool_parser == "gemma4"
    assert get_recipe("minimax_m3").tool_parser == "minimax"
    assert get_recipe("mimo_v2").tool_parser == "mimo"
    ds41 = get_recipe("deepseek41")
    assert ds41.effort_levels == ("low", "high", "xhigh", "max") and ds41.default_effort == "high"
    assert ds41.effort_score_range == (1, 100)
    assert ds41.effort_scores == {"low": 50, "high": 75, "xhigh": 75, "max": 100}
    kimi = get_recipe("kimi3")
    assert kimi.effort_levels == ("low", "high", "max") and kimi.default_effort == "max"
    assert get_recipe("qwen25").tool_parser == "hermes"
    assert (get_recipe("qwen3").tool_parser, get_recipe("qwen3").reasoning_parser) == ("hermes", "think")


@pytest.mark.parametrize("name", ["qwen38", "glm53", "deepseek41", "kimi3", "qwen25", "default"])
def test_no_sampling_ranges_fixes_every_parameter(name):
    _, sampling = resolve(name, {}, sampling_ranges=False)
    assert sampling.ranges == SamplingRanges()
    assert all(getattr(sampling.ranges, f) is None for f in RANGE_FIELDS)
    assert sampling.defaults == resolve(name, {})[1].defaults


def test_every_recipe_validates():
    for name in list_recipes():
        validate(get_recipe(name))


def _with(name="qwen38", defaults=None, **fields):
    spec = get_recipe(name)
    if defaults:
        fields["defaults"] = msgspec.structs.replace(spec.defaults, **defaults)
    return msgspec.structs.replace(spec, **fields)


@pytest.mark.parametrize(
    "spec, message",
    [
        (_with(ranges=SamplingRanges(temperature=Range(min=0.1, max=0.5))), "excludes its default"),
        (_with(ranges=SamplingRanges(temperature=Range(min=0.0, max=1.0))), "temperature range min"),
        (_with(ranges=SamplingRanges(top_p=Range(min=0.5, max=1.5))), "top_p range max"),
        (_with(ranges=SamplingRanges(top_p=Range(min=0.0, max=1.0))), "top_p range min"),
        (_with(ranges=SamplingRanges(top_k=Range(min=1, max=40.5))), "top_k range max"),
        (_with(ranges=SamplingRanges(top_k=Range(min=-2, max=40))), "top_k range min"),
        (_with(ranges=SamplingRanges(min_p=Range(min=0.0, max=1.2))), "min_p range max"),
        (_with(ranges=SamplingRanges(repetition_penalty=Range(min=0.0, max=1.2))), "repetition_penalty"),
        (_with(ranges=SamplingRanges(presence_penalty=Range(min=0.0, max=3.0))), "presence_penalty"),
        (_with(ranges=SamplingRanges(top_p=Range(min=0.96, max=0.9))), "is empty"),
        (_with(ranges=SamplingRanges(temperature=Range(min=0.5, max=float("inf")))), "finite"),
        (_with(defaults={"temperature": 0.0}, ranges=SamplingRanges()), "default temperature"),
        (_with(defaults={"top_k": 0}), "default top_k"),
        (_with(defaults={"min_p": -0.1}), "default min_p"),
        (_with(tool_parser="nonesuch"), "unknown tool parser"),
        (_with(reasoning_parser="nonesuch"), "unknown reasoning parser"),
        (_with(default_effort="max"), "default effort"),
        (_with(effort_levels=("low", "low")), "duplicate effort"),
        (_with("deepseek41", effort_scores={"max": 101}), "outside"),
    ],
)
def test_invalid_recipe_rejected(spec, message):
    with pytest.raises(ExportError, match=message):
        validate(spec)


def test_top_k_range_may_span_disabled():
    validate(_with(ranges=SamplingRanges(top_k=Range(min=-1, max=100))))


def test_unknown_recipe():
    with pytest.raises(ExportError, match="unknown recipe 'nope'.*qwen38"):
        get_recipe("nope")


# --- from-generation-config recipes ----------------------------------------------------------------------


def test_smollm2_without_sampling_fields():
    _, sampling = resolve("smollm2", {"bos_token_id": 1, "eos_token_id": 2})
    assert sampling.defaults == SamplingDefaults(temperature=1.0, top_p=1.0, top_k=-1)
    assert sampling.ranges.temperature == Range(min=0.05, max=2.0)
    assert sampling.ranges.top_k == Range(min=-1, max=1000)


def test_qwen25_generation_config_overrides_fallbacks():
    fallback = resolve("qwen25", {})[1].defaults
    assert (fallback.temperature, fallback.top_p, fallback.top_k, fallback.repetition_penalty) == (0.7, 0.8, 20, 1.05)
    gc = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.1}
    recipe, sampling = resolve("qwen25", gc)
    assert recipe == Recipe(name="qwen25", tool_parser="hermes")
    d = sampling.defaults
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.min_p) == (0.7, 0.8, 20, 1.1, 0.0)
    for field in RANGE_FIELDS:
        bound = getattr(sampling.ranges, field)
        assert bound is not None and bound.min <= getattr(d, field) <= bound.max


def test_gemma3_and_qwen3_fallbacks():
    g = resolve("gemma3", {})[1].defaults
    assert (g.temperature, g.top_p, g.top_k) == (1.0, 0.95, 64)
    q = resolve("qwen3", {"temperature": 0.6, "top_p": 0.95, "top_k": 20})[1].defaults
    assert (q.temperature, q.top_p, q.top_k) == (0.6, 0.95, 20)


def test_do_sample_false_is_ignored_and_top_k_zero_disables():
    d = resolve("default", {"do_sample": False, "temperature": 0.9, "top_k": 0, "min_p": 0.05})[1].defaults
    assert (d.temperature, d.top_k, d.min_p) == (0.9, -1, 0.05)


def test_ranges_widen_to_checkpoint_defaults():
    _, sampling = resolve("default", {"temperature": 2.5, "repetition_penalty": 0.9})
    assert sampling.ranges.temperature == Range(min=0.05, max=2.5)
    assert sampling.ranges.repetition_penalty == Range(min=0.9, max=2.0)


@pytest.mark.parametrize(
    "gc, message",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 2.5}, "top_k must be an integer"),
        ({"top_k": True}, "top_k must be a number"),
        ({"temperature": "hot"}, "temperature must be a number"),
    ],
)
def test_bad_generation_config_rejected(gc, message):
    with pytest.raises(ExportError, match=message):
        resolve("default", gc)


def test_sampling_round_trips_through_msgspec():
    _, sampling = resolve("qwen25", {"top_k": 20})
    assert msgspec.convert(msgspec.to_builtins(sampling), Sampling) == sampling


@pytest.mark.parametrize(
    "family, identifier, expected",
    [
        ("llama", "HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2"),
        ("llama", "SmolLM2-135M-Instruct.Q4_1.gguf", "smollm2"),
        ("llama", "meta-llama/Llama-3.2-1B-Instruct", "default"),
        ("qwen2", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "qwen25"),
        ("qwen2", "Qwen/Qwen2.5-0.5B-Instruct", "qwen25"),
        ("qwen2", "Qwen/Qwen2.5-0.5B", "default"),
        ("qwen3", "Qwen/Qwen3-0.6B", "qwen3"),
        ("qwen3_moe", "Qwen/Qwen3-30B-A3B", "qwen3"),
        ("gemma3", "google/gemma-3-1b-it", "gemma3"),
        ("qwen3_5", "Qwen/Qwen3.8-27B", "qwen38_dense"),
        ("qwen3_5", "Qwen/Qwen3.5-27B", "default"),
        ("qwen4_exp", "Qwen/Qwen3.8-Flash-Next", "qwen38"),
        ("glm5_next", "zai-org/GLM-5.3-Flash", "glm53"),
        ("nemotron_h", "nvidia/Nemotron-3.5-Bolt", "nemotron_h"),
        ("deepseek_v4", "deepseek-ai/DeepSeek-V4-Flash-Vision-Exp", "deepseek4"),
        ("deepseek_v4", "deepseek-ai/DeepSeek-V4.1-Flash-1017", "deepseek41"),
        ("gemma4", "google/gemma-4-e2b-it", "gemma4"),
        ("kimi_linear", "moonshotai/Kimi-Linear-48B-A3B-Instruct", "default"),
    ],
)
def test_auto_recipe(family, identifier, expected):
    assert auto_recipe(family, identifier) == expected
