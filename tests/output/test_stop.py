from __future__ import annotations

from hypothesis import given, strategies as st

from helios.output.stop import StopMatcher, TokenSequenceHoldback


def _run(stops, pieces):
    m = StopMatcher(stops)
    out = ""
    for p in pieces:
        text, matched = m.feed(p)
        out += text
        if matched:
            return out, matched, m
    return out + m.flush(), None, m


def test_stop_across_token_boundaries():
    out, matched, m = _run(["\n\nUser:"], ["Hello", "\n", "\nUs", "er:", " more"])
    assert (out, matched) == ("Hello", "\n\nUser:")
    assert m.match_pos == 5


def test_stop_inside_one_token_cuts_it():
    out, matched, _ = _run(["lo w"], ["hel", "lo world"])
    assert (out, matched) == ("hel", "lo w")


def test_partial_match_is_held_then_released():
    m = StopMatcher(["STOP"])
    assert m.feed("abc ST") == ("abc ", None)
    assert m.feed("x") == ("STx", None)
    assert m.feed("S") == ("", None)
    assert m.flush() == "S"


def test_earliest_stop_wins():
    out, matched, _ = _run(["world", "lo"], ["hello world"])
    assert (out, matched) == ("hel", "lo")


@given(st.text(alphabet="ab\n", max_size=30), st.lists(st.integers(1, 5), max_size=10))
def test_matches_a_whole_text_search(text, sizes):
    stop = "a\nb"
    pieces, i = [], 0
    for n in sizes + [len(text)]:
        pieces.append(text[i : i + n])
        i += n
    out, matched, _ = _run([stop], pieces)
    pos = text.find(stop)
    if pos >= 0:
        assert (out, matched) == (text[:pos], stop)
    else:
        assert (out, matched) == (text, None)


def test_token_sequence_holdback():
    h = TokenSequenceHoldback([[5, 6, 7], [9]])
    assert h.hold_len([1, 2]) == 0
    assert h.hold_len([1, 5]) == 1
    assert h.hold_len([5, 6]) == 2
    assert h.hold_len([5, 6, 8]) == 0
