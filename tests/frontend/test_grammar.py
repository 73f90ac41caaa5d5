"""helios.frontend.grammar: bounded Lark/regex compilation through llguidance and exact-byte matching."""

from __future__ import annotations

import pytest

from helios.frontend.grammar import MAX_DEFINITION_BYTES, compile_grammar
from helios.frontend.sampling import InvalidRequest

# Codex's freeform apply_patch tool grammar: the custom tool the spec's client catalog relies on
APPLY_PATCH = r'''start: begin_patch hunk+ end_patch
begin_patch: "*** Begin Patch" LF
end_patch: "*** End Patch" LF?

hunk: add_hunk | delete_hunk | update_hunk
add_hunk: "*** Add File: " filename LF add_line+
delete_hunk: "*** Delete File: " filename LF
update_hunk: "*** Update File: " filename LF change_move? change?

filename: /(.+)/
add_line: "+" /(.*)/ LF -> line

change_move: "*** Move to: " filename LF
change: (change_context | change_line)+ eof_line?
change_context: ("@@" | "@@ " /(.+)/) LF
change_line: ("+" | "-" | " ") /(.*)/ LF
eof_line: "*** End of File" LF

%import common.LF
'''
PATCH = "*** Begin Patch\n*** Update File: a.py\n@@ def f():\n-    return 1\n+    return 2\n*** End Patch\n"


def test_regex_matches_whole_input_only():
    g = compile_grammar("regex", r"\d{3}-\d{4}")
    assert g.match(b"555-1234") is None
    assert "byte 8" in g.match(b"555-12345")  # a longer input is not a match of the whole
    assert "before a sentence of the grammar is complete" in g.match(b"555-123")
    assert "byte 0" in g.match(b"x")
    assert "ends after 0 bytes" in g.match(b"")


def test_lark_grammar_and_exact_bytes():
    g = compile_grammar("lark", 'start: "hello " NAME\nNAME: /[a-z]+/')
    assert g.match(b"hello bob") is None
    assert g.match(b"hello bob ") is not None  # trailing whitespace is a byte like any other
    assert g.match(b"Hello bob") is not None
    u = compile_grammar("regex", "é+")
    assert u.match("éé".encode()) is None
    assert u.match("éé".encode()[:-1]) is not None  # a cut UTF-8 sequence is not é


def test_codex_apply_patch_grammar():
    g = compile_grammar("lark", APPLY_PATCH)
    assert g.match(PATCH.encode()) is None
    assert g.match(PATCH.replace("*** End Patch\n", "").encode()) is not None
    assert "Lark grammar" in g.contract and "*** Begin Patch" in g.contract


def test_each_match_starts_fresh():
    g = compile_grammar("regex", "ab")
    assert g.match(b"a") is not None
    assert g.match(b"ab") is None and g.match(b"ab") is None


@pytest.mark.parametrize("syntax, definition, words", [
    ("lark", "start: foo", 'unknown name: "foo"'),
    ("lark", 'start: "a"\nstart: "b"', "duplicate rule"),
    ("regex", "(ab", "unclosed group"),
    ("ebnf", "start: 'a'", "unsupported grammar syntax"),
    ("lark", "", "nonempty string definition"),
])
def test_invalid_grammars_are_invalid_requests(syntax, definition, words):
    with pytest.raises(InvalidRequest) as e:
        compile_grammar(syntax, definition, "tools")
    assert words in e.value.message and e.value.param == "tools"


def test_definition_size_is_bounded():
    big = "start: " + " | ".join(f'"w{i}"' for i in range(MAX_DEFINITION_BYTES // 6))
    assert len(big.encode()) > MAX_DEFINITION_BYTES
    with pytest.raises(InvalidRequest, match="exceeds"):
        compile_grammar("lark", big)


def test_exhausted_work_bound_is_reported_not_hung():
    # the lexer of this regex needs more states than the bound allows once the input is long enough
    g = compile_grammar("regex", "(a|b)*a(a|b){20000}")
    why = g.match(b"ab" * 2000)
    assert why is not None and "too complex" in why
