from __future__ import annotations

from hypothesis import given, strategies as st

from helios.output.detokenizer import IncrementalDetokenizer, complete_prefix_len


def _split_table(text: str, cuts: list[int]) -> list[bytes]:
    data = text.encode()
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


def test_emoji_split_across_tokens_is_held_back():
    emoji = "🎉".encode()  # 4 bytes
    table = [b"ok ", emoji[:1], emoji[1:3], emoji[3:], "中".encode()[:2], "中".encode()[2:]]
    d = IncrementalDetokenizer(table)
    assert d.push(0) == "ok "
    assert d.push(1) == "" and d.push(2) == "" and d.num_chars == 3
    assert d.push(3) == "🎉"
    assert d.push(4) == ""
    assert d.push(5) == "中"
    assert d.num_chars == 5 and d.flush() == ""


def test_flush_replaces_a_dangling_partial_sequence():
    d = IncrementalDetokenizer([b"a", "é".encode()[:1]])
    assert d.push(0) + d.push(1) == "a"
    assert d.flush() == "\ufffd"


def test_special_tokens_are_skipped_by_default():
    table = [b"x", b"<|im_end|>"]
    assert IncrementalDetokenizer(table, frozenset({1})).push(1) == ""
    assert IncrementalDetokenizer(table, frozenset({1}), skip_special_tokens=False).push(1) == "<|im_end|>"


def test_invalid_bytes_do_not_stall():
    d = IncrementalDetokenizer([b"\xff", b"a", b"\x80\x80\x80\x80"])
    assert d.push(0) == "\ufffd" and d.push(1) == "a"
    assert d.push(2) == "\ufffd" * 4


@given(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 200), max_size=12))
def test_any_split_reassembles_the_text(text, cuts):
    table = _split_table(text, cuts)
    d = IncrementalDetokenizer(table)
    out = "".join(d.push(i) for i in range(len(table))) + d.flush()
    assert out == text
    assert d.num_chars == len(text)


def test_complete_prefix_len():
    assert complete_prefix_len(b"abc") == 3
    assert complete_prefix_len("é".encode()[:1]) == 0
    assert complete_prefix_len(b"a" + "🎉".encode()[:3]) == 1
    assert complete_prefix_len("🎉".encode()) == 4
