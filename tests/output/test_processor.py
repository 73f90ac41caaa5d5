from __future__ import annotations

from helios.engine.messages import EngineOutput, PositionLogprobs, SamplingParams, TokenLogprob
from helios.output.processor import OutputProcessor

EMOJI = "🎉".encode()
TABLE = [b"Hel", b"lo", b" wor", b"ld", b"<eos>", EMOJI[:2], EMOJI[2:], b"\n", b"U", b"ser"]
EOS = 4


def _rec(tid, lp=-0.5):
    return PositionLogprobs(TokenLogprob(tid, lp, 1), [TokenLogprob(tid, lp, 1), TokenLogprob(99, lp - 1, 2)])


def _out(ids, finished=False, reason=None, stop_token=None):
    return EngineOutput(req_id="r", new_token_ids=ids, logprobs=[_rec(i) for i in ids], finished=finished,
                        finish_reason=reason, stop_token=stop_token, num_prompt_tokens=3)


def _proc(stops=(), **kw):
    return OutputProcessor(TABLE, frozenset({EOS}), SamplingParams(logprobs=1, **kw), stops)


def test_eos_is_hidden_from_text_and_logprobs():
    p = _proc()
    d1 = p.process(_out([0, 1]))
    d2 = p.process(_out([EOS], finished=True, reason="stop", stop_token=EOS))
    assert d1.text == "Hello" and [e.token_id for e in d1.entries] == [0, 1]
    assert d2.text == "" and d2.entries == [] and d2.finish_reason == "stop"
    assert p.num_generated == 3 and [e.text_offset for e in d1.entries] == [0, 3]


def test_eos_under_ignore_eos_keeps_its_entry():
    p = _proc(ignore_eos=True)
    d = p.process(_out([0, EOS, 1], finished=True, reason="length"))
    assert d.text == "Hello" and [e.token_id for e in d.entries] == [0, EOS, 1]
    assert d.finish_reason == "length"


def test_partial_utf8_entries_stream_before_their_text():
    p = _proc()
    d1 = p.process(_out([5]))
    assert d1.text == "" and [e.token_bytes for e in d1.entries] == [EMOJI[:2]]
    d2 = p.process(_out([6]))
    assert d2.text == "🎉" and d2.entries[0].text_offset == 0


def test_string_stop_clips_a_token_and_drops_later_entries():
    p = _proc(stops=["lo w"])
    d = p.process(_out([0, 1, 2, 3]))
    assert d.text == "Hel" and d.finished and d.finish_reason == "stop" and d.stop_reason == "lo w"
    # "lo" starts inside the stop: no entry; "Hel" keeps its entry
    assert [e.token_id for e in d.entries] == [0]
    assert p.process(_out([3])).text == ""


def test_clipped_token_keeps_entry_with_full_bytes():
    p = _proc(stops=["o w"])
    d = p.process(_out([0, 1, 2]))
    assert d.text == "Hell" and [(e.token_id, e.token_bytes) for e in d.entries] == [(0, b"Hel"), (1, b"lo")]


def test_held_stop_prefix_is_released_at_the_end():
    p = _proc(stops=["\nUser"])
    d1 = p.process(_out([0, 7]))
    assert d1.text == "Hel" and [e.token_id for e in d1.entries] == [0]
    d2 = p.process(_out([8], finished=True, reason="length"))
    assert d2.text == "\nU" and [e.token_id for e in d2.entries] == [7, 8]


def test_stop_token_sequence_is_withheld_and_hidden():
    p = _proc(stop_token_sequences=((7, 8, 9),))
    d1 = p.process(_out([0, 7, 8]))
    assert d1.text == "Hel"
    d2 = p.process(_out([9], finished=True, reason="stop", stop_token=[7, 8, 9]))
    assert d2.text == "" and d2.entries == [] and p.text == "Hel"


def test_broken_sequence_prefix_is_released():
    p = _proc(stop_token_sequences=((7, 8, 9),))
    assert p.process(_out([7])).text == ""
    assert p.process(_out([1])).text == "\nlo"


def test_explicit_ids_append_the_chosen_token():
    sp = SamplingParams(logprobs=0, logprob_token_ids=(99,))
    p = OutputProcessor(TABLE, frozenset(), sp)
    out = EngineOutput(req_id="r", new_token_ids=[0],
                       logprobs=[PositionLogprobs(TokenLogprob(0, -0.1, 1), [TokenLogprob(99, -3.0, 7)])])
    d = p.process(out)
    assert [t.token_id for t in d.entries[0].top] == [99, 0]


# --- (token_id, text) pairs for the output parsers -------------------------------------------------------

SPECIAL = 8  # "U" stands in for a special token such as <tool_call>


def _pairs_proc(stops=(), **kw):
    return OutputProcessor(TABLE, frozenset({EOS, SPECIAL}), SamplingParams(**kw), stops)


def _all_pairs(p, outs):
    pairs = []
    for out in outs:
        pairs += p.process(out).tokens
    return pairs


def test_pairs_keep_special_text_and_hide_the_terminating_eos():
    p = _pairs_proc()
    pairs = _all_pairs(p, [_out([0, SPECIAL, 1]), _out([EOS], True, "stop", EOS)])
    assert pairs == [(0, "Hel"), (SPECIAL, "U"), (1, "lo")]
    assert p.text == "Hello"  # the visible text still hides the special


def test_pairs_under_ignore_eos_give_eos_no_text():
    p = _pairs_proc(ignore_eos=True, eos_token_ids=[EOS])
    assert _all_pairs(p, [_out([0, EOS, 1], True, "length")]) == [(0, "Hel"), (EOS, ""), (1, "lo")]


def test_pairs_wait_for_held_stop_text_and_cut_at_the_stop():
    p = _pairs_proc(stops=["lo w"])
    d1 = p.process(_out([0, 1]))
    assert d1.text == "Hel" and d1.tokens == [(0, "Hel")]  # "lo" may begin the stop: held with its token
    d2 = p.process(_out([2, 3]))
    assert d2.finished and d2.tokens == []  # the stop begins at "lo": nothing of it or after it is parsed
    p = _pairs_proc(stops=["o w"])
    assert _all_pairs(p, [_out([0, 1, 2, SPECIAL])]) == [(0, "Hel"), (1, "l")]


def test_pairs_release_a_held_tail_at_the_end_and_split_utf8_once():
    p = _pairs_proc(stops=["xyz"])
    pairs = _all_pairs(p, [_out([5]), _out([6, 7]), _out([], True, "length")])
    assert pairs == [(5, ""), (6, "🎉"), (7, "\n")]
    p = _pairs_proc()
    assert _all_pairs(p, [_out([0, 5], True, "length")]) == [(0, "Hel"), (5, ""), (-1, "\ufffd")]


def test_pairs_on_client_finish():
    p = _pairs_proc(stops=["ld!"])
    d = p.process(_out([2, 3]))
    assert d.tokens == [(2, " wor")]
    assert p.finish_by_client().tokens == [(3, "ld")]
