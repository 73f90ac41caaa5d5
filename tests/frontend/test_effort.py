"""The effort resolver: neutral levels -> the recipe's vocabulary, the Messages budget rule, request checks.

Recipes come from ignition's table (resolved as an export would), so a change to a recipe's vocabulary
shows up here."""

from __future__ import annotations

import pytest

from helios.core.manifest import Recipe
from helios.frontend.effort import (EFFORT_VARIABLE, NEUTRAL_LEVELS, budget_effort, effort_template_kwargs,
                                    messages_effort, named_effort, native_effort, nearest_level, resolve_effort)
from helios.frontend.sampling import InvalidRequest
from ignition.recipes import resolve


def recipe(name: str) -> Recipe:
    return resolve(name, {})[0]


# Every neutral level, lowest first, against each vocabulary of the spec's recipes.
@pytest.mark.parametrize("name,expected", [
    ("qwen38", ["low", "low", "low", "medium", "xhigh", "xhigh", "xhigh"]),
    ("deepseek4", ["low", "low", "low", "high", "high", "xhigh", "max"]),
    ("kimi3", ["low", "low", "low", "high", "high", "max", "max"]),
])
def test_each_neutral_level_goes_to_the_nearest_vocabulary_level_ties_up(name, expected):
    r = recipe(name)
    assert [resolve_effort(level, r) for level in NEUTRAL_LEVELS] == expected


def test_deepseek41_templates_receive_scores():
    r = recipe("deepseek41")
    assert [resolve_effort(level, r) for level in ("low", "medium", "high", "xhigh", "max")] == [50, 75, 75, 75, 100]
    assert resolve_effort(80, r) == 80
    assert resolve_effort(None, r) == 75  # default high


def test_defaults_come_from_the_recipe():
    assert resolve_effort(None, recipe("kimi3")) == "max"
    assert resolve_effort(None, recipe("deepseek4")) == "high"
    assert resolve_effort(None, recipe("qwen38")) is None  # no default: the template's own


def test_no_vocabulary_ignores_effort():
    r = recipe("smollm2")
    assert r.effort_levels == []
    assert resolve_effort("high", r) is None
    kwargs = {"enable_thinking": False, EFFORT_VARIABLE: "anything"}
    assert effort_template_kwargs(kwargs, "high", r) == kwargs  # verbatim: the template's own semantics


def test_nearest_level_edge_cases():
    assert nearest_level("high", ["high"]) == "high"
    assert nearest_level("none", ["max"]) == "max"
    assert nearest_level("medium", ["custom"]) is None  # nothing on the neutral scale


@pytest.mark.parametrize("budget,level", [(1, "low"), (5_000, "low"), (5_001, "high"), (20_000, "high"),
                                          (20_001, "max"), (2**40, "max")])
def test_budget_selects_effort(budget, level):
    assert budget_effort(budget) == level


def test_messages_effort_explicit_wins_over_budget():
    assert messages_effort(None, "enabled", 1024) == "low"
    assert messages_effort(None, "adaptive", 30_000) == "max"
    assert messages_effort("medium", "enabled", 30_000) == "medium"
    assert messages_effort(None, "disabled", 30_000) is None
    assert messages_effort(None, None, None) is None


@pytest.mark.parametrize("value", [3, 80.0, True, "extreme", ""])
def test_named_effort_refuses_numbers_and_unknown_names(value):
    with pytest.raises(InvalidRequest) as e:
        named_effort(value, "reasoning", "reasoning.effort")
    assert e.value.param == "reasoning" and "reasoning.effort" in e.value.message


def test_native_effort_integers_only_within_the_declared_range():
    ds41 = recipe("deepseek41")
    assert native_effort(1, ds41, "reasoning_effort") == 1 and native_effort(100, ds41, "reasoning_effort") == 100
    assert native_effort("max", ds41, "reasoning_effort") == "max"
    for bad, needle in [(0, "1 through 100"), (101, "1 through 100"), (80.0, "JSON integer"), (True, "JSON integer"),
                        (False, "JSON integer"), ("80", "not the string"), (" 80", "not the string"),
                        ("huge", "must be one of"), ([80], "JSON integer")]:
        with pytest.raises(InvalidRequest, match=needle) as e:
            native_effort(bad, ds41, "reasoning_effort")
        assert e.value.param == "reasoning_effort"
    for name in ("deepseek4", "qwen38", "smollm2"):  # no score range: named levels only
        with pytest.raises(InvalidRequest, match="no numeric effort"):
            native_effort(80, recipe(name), "reasoning_effort")


def test_template_kwargs_native_option_wins_and_is_checked():
    ds41, qwen = recipe("deepseek41"), recipe("qwen38")
    assert effort_template_kwargs(None, None, qwen) == {}
    assert effort_template_kwargs({"x": 1}, "high", qwen) == {"x": 1, EFFORT_VARIABLE: "xhigh"}
    assert effort_template_kwargs({EFFORT_VARIABLE: "low"}, "high", qwen) == {EFFORT_VARIABLE: "low"}
    assert effort_template_kwargs({EFFORT_VARIABLE: 80}, "low", ds41) == {EFFORT_VARIABLE: 80}
    assert effort_template_kwargs({EFFORT_VARIABLE: None}, None, ds41) == {EFFORT_VARIABLE: 75}  # null: default
    with pytest.raises(InvalidRequest, match="chat_template_kwargs.reasoning_effort") as e:
        effort_template_kwargs({EFFORT_VARIABLE: 80.0}, None, ds41)
    assert e.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequest, match="no numeric effort"):
        effort_template_kwargs({EFFORT_VARIABLE: 80}, None, qwen)
