"""Reasoning parsers: single-token delimiters by id only, multi-token and DeepSeek delimiters as text."""

from __future__ import annotations

from tests.output.parsers import THINK_CLOSE, THINK_OPEN, WORD, parser, run, texts, think_syntax

from helios.core.manifest import ReasoningSyntax


def test_single_token_delimiters_switch_regions():
    p = parser(reasoning="think", syntax=think_syntax())
    events = run(p, [(THINK_OPEN, "<think>"), "Let me", " think.", (THINK_CLOSE, "</think>"), "\n\nAnswer", "."])
    assert texts(events) == [("reasoning", "Let me think."), ("text", "\n\nAnswer.")]
    assert p.num_reasoning_tokens == 2  # the two tokens inside; the delimiter tokens are not counted


def test_delimiter_spelled_in_pieces_stays_text():
    # the model explains a chat template: "</think>" written as ordinary pieces does not close reasoning
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    stream = ["The template writes ", "</", "think", ">", " after reasoning.", (THINK_CLOSE, "</think>"), "Done"]
    events = run(p, stream)
    assert texts(events) == [("reasoning", "The template writes </think> after reasoning."), ("text", "Done")]


def test_opening_delimiter_in_pieces_stays_answer_text():
    p = parser(reasoning="think", syntax=think_syntax())
    assert texts(run(p, ["Use ", "<th", "ink>", " tags"])) == [("text", "Use <think> tags")]


def test_starts_in_reasoning_per_template_caps():
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    assert texts(run(p, ["hmm", (THINK_CLOSE, "</think>"), "ok"])) == [("reasoning", "hmm"), ("text", "ok")]
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=False))
    assert texts(run(p, ["just an answer"])) == [("text", "just an answer")]


def test_skipped_special_delimiter_text_is_empty():
    # a detokenizer that skips specials hands the delimiter over as "": the id alone switches
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    assert texts(run(p, ["a", (THINK_CLOSE, ""), "b"])) == [("reasoning", "a"), ("text", "b")]


def test_real_close_written_in_pieces_keeps_reasoning_open():
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    assert texts(run(p, ["x", "</think>", "still reasoning"])) == [("reasoning", "x</think>still reasoning")]


def test_close_token_inside_answer_is_answer_text():
    # a structured answer may contain the delimiter token: it returns as text
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    events = run(p, ["r", (THINK_CLOSE, "</think>"), '{"a": "', (THINK_CLOSE, "</think>"), '"}'])
    assert texts(events) == [("reasoning", "r"), ("text", '{"a": "</think>"}')]


def test_gemma4_open_matched_as_text_close_by_id():
    close_id = 212
    syntax = ReasoningSyntax(open="<|channel>thought", close="<channel|>", open_token_id=None,
                             close_token_id=close_id)
    p = parser(reasoning="gemma4", syntax=syntax)
    events = run(p, [(100, "<|channel>"), "thought", "\nPlan", (close_id, "<channel|>"), "Answer"])
    assert texts(events) == [("reasoning", "\nPlan"), ("text", "Answer")]
    # the close spelled in pieces is reasoning text; a partial open at the end is answer text
    p = parser(reasoning="gemma4", syntax=syntax)
    assert texts(run(p, ["<|channel>thought", "a<channel", "|>b"])) == [("reasoning", "a<channel|>b")]
    p = parser(reasoning="gemma4", syntax=syntax)
    assert texts(run(p, ["ok <|chan"])) == [("text", "ok <|chan")]


def test_deepseek_delimiters_matched_as_text():
    p = parser(reasoning="dsml")  # native encoder: no probed syntax, text-matched think tags
    events = run(p, ["<th", "ink>plan</t", "hink>", "answer"])
    assert texts(events) == [("reasoning", "plan"), ("text", "answer")]
    syntax = think_syntax(starts_in_reasoning=True)  # even when the core knows token ids
    p = parser(reasoning="dsml", syntax=syntax)
    assert texts(run(p, ["plan", "</think>", "answer"])) == [("reasoning", "plan"), ("text", "answer")]


def test_minimax_namespaced_think():
    syntax = ReasoningSyntax(open="<mm:think>", close="</mm:think>", open_token_id=300, close_token_id=301)
    p = parser(reasoning="minimax", syntax=syntax)
    events = run(p, [(300, "<mm:think>"), "r", (WORD, "</mm:think>"), (301, "</mm:think>"), "a"])
    assert texts(events) == [("reasoning", "r</mm:think>"), ("text", "a")]


def test_delimiter_token_text_merged_with_held_text():
    # a stop-string holdback can release earlier text together with the delimiter token's text
    p = parser(reasoning="think", syntax=think_syntax(starts_in_reasoning=True))
    assert texts(run(p, ["a", (THINK_CLOSE, "b</think>c"), "d"])) == [("reasoning", "ab"), ("text", "cd")]


def test_no_reasoning_syntax_means_no_reasoning_parser():
    p = parser(tool=None, reasoning="think", syntax=None)  # helper builds one from defaults; build() would not
    from helios.output.parsers import build

    assert build(None, "think", None).reasoning is None
    assert p.reasoning is not None
