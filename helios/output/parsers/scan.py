"""Incremental matching helpers for start checks: each answers a position, WAIT (may still match) or FAIL.

Used by the syntaxes whose opener starts a call only when a header follows (Qwen, GLM, Hermes), so a
decision never depends on how the text was split. Pure Python.
"""

from __future__ import annotations

WAIT = -1  # the text so far is a proper prefix of a match
FAIL = -2  # it cannot match
MAX_NAME_CHARS = 256  # a longer "name" is prose, not a header


def skip_ws(buf: str, pos: int) -> int:
    while pos < len(buf) and buf[pos].isspace():
        pos += 1
    return pos


def literal(buf: str, pos: int, lit: str) -> int:
    """Position after `lit` at `pos`, WAIT if the buffer ends inside it, FAIL otherwise."""
    if pos < 0:
        return pos
    got = buf[pos:pos + len(lit)]
    if got == lit:
        return pos + len(lit)
    return WAIT if lit.startswith(got) else FAIL


def any_literal(buf: str, pos: int, lits: tuple[str, ...]) -> int:
    if pos < 0:
        return pos
    results = [literal(buf, pos, lit) for lit in lits]
    done = [r for r in results if r >= 0]
    if done:
        return done[0]
    return WAIT if WAIT in results else FAIL


def name_until(buf: str, pos: int, stop: str, forbidden: str = "<>\n") -> tuple[int, str]:
    """A nonempty name up to (not including) the `stop` char: (position of stop, name) or (WAIT|FAIL, "")."""
    if pos < 0:
        return pos, ""
    end = pos
    while end < len(buf) and buf[end] != stop:
        if buf[end] in forbidden or end - pos >= MAX_NAME_CHARS:
            return FAIL, ""
        end += 1
    if end == len(buf):
        return WAIT, ""
    return (end, buf[pos:end]) if end > pos else (FAIL, "")


def bare_name(buf: str, pos: int) -> tuple[int, str]:
    """A nonempty run of non-space chars without < or > : (end, name); WAIT when the buffer ends in it."""
    if pos < 0:
        return pos, ""
    end = pos
    while end < len(buf) and not buf[end].isspace() and buf[end] not in "<>":
        if end - pos >= MAX_NAME_CHARS:
            return FAIL, ""
        end += 1
    if end == len(buf):
        return WAIT, ""
    return (end, buf[pos:end]) if end > pos else (FAIL, "")


def verdict(pos: int) -> str:
    return "wait" if pos == WAIT else "text" if pos == FAIL else "ok"
