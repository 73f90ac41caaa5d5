"""Lark and regex grammars through llguidance: bounded compilation at admission, exact-byte validation after.

Owns the one grammar compiler of helios (Responses custom tools today; structured output uses the same
bounds): a definition is compiled once before admission (a bad or oversized grammar is an InvalidRequest),
and a completed text is checked byte by byte against it. Matching runs over a private 256-symbol byte
vocabulary, so the verdict depends on the exact UTF-8 bytes, never on how a model tokenizer splits them.
No torch; llguidance is imported here only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from helios.frontend.sampling import InvalidRequest

GrammarSyntax = Literal["lark", "regex"]
SYNTAXES: tuple[str, ...] = ("lark", "regex")

MAX_DEFINITION_BYTES = 64 * 1024  # a grammar definition's UTF-8 size
MAX_GRAMMAR_SYMBOLS = 100_000  # llguidance max_grammar_size: symbols in all productions (default 500k)
MAX_LEXER_FUEL = 1_000_000  # llguidance initial_lexer_fuel: regex analysis work at compile time (~20 ms)
MAX_LEXER_STATES = 50_000  # llguidance max_lexer_states: ~1-2 kB each
MAX_ERROR_CHARS = 400  # compiler messages quote the grammar; keep a refusal readable

_EOS = 256  # the byte vocabulary's end symbol; never consumed


class _ByteVocabulary:
    """Token i is byte i: what llguidance.TokenizerWrapper reads from a tokenizer."""

    eos_token_id = _EOS
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [_EOS]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode("utf-8") if isinstance(text, str) else text)


@lru_cache(maxsize=1)
def _tokenizer():
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteVocabulary()), slices=[])


def _limits():
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, initial_lexer_fuel=MAX_LEXER_FUEL,
                                     max_lexer_states=MAX_LEXER_STATES, verbose_errors=False)


# compiler messages quote the source under the error: "  1 | start: foo" and a "^" marker line
_QUOTE = re.compile(r"\s*(\d+ \||\^|<non-verbose/>)")
_EXHAUSTED = re.compile(r"(?i)too (many|complex)|fuel|limit")  # llguidance's messages for exhausted bounds


def _first_line(message: str) -> str:
    return message.strip().splitlines()[0] if message.strip() else "unknown error"


@dataclass(frozen=True)
class Grammar:
    """A compiled grammar; `match(data)` is None when data is a complete sentence, else why it is not."""

    syntax: GrammarSyntax
    definition: str
    _matcher: object  # llguidance.LLMatcher at its start state; each match works on a deep copy

    @property
    def contract(self) -> str:
        """The grammar as the model is told about it (a tool description, a system prompt)."""
        if self.syntax == "regex":
            return f"The input must match this regular expression in full:\n{self.definition}"
        return f"The input must be a sentence of this Lark grammar (llguidance dialect):\n{self.definition}"

    def match(self, data: bytes) -> str | None:
        m = self._matcher.deep_copy()  # type: ignore[attr-defined]
        num_ok = m.try_consume_tokens(list(data))
        if num_ok < len(data):
            m.consume_token(data[num_ok])  # enters the error state that says why
            error = m.get_error()
            if _EXHAUSTED.search(error):  # NOTE: a work bound ran out; the byte itself may be fine
                return f"the grammar is too complex to check this input at byte {num_ok}: {_first_line(error)}"
            return f"byte {num_ok} ({data[num_ok:num_ok + 1]!r}) cannot continue a sentence of the grammar"
        if not m.is_accepting():
            return f"the input ends after {len(data)} bytes, before a sentence of the grammar is complete"
        return None


def compile_grammar(syntax: str, definition: str, param: str | None = None) -> Grammar:
    """Compile a Lark or regex definition under the bounds above; InvalidRequest names what is wrong."""
    import llguidance

    if syntax not in SYNTAXES:
        raise InvalidRequest(f"unsupported grammar syntax {syntax!r}; use lark or regex", param)
    if not isinstance(definition, str) or not definition:
        raise InvalidRequest("a grammar needs a nonempty string definition", param)
    if len(definition.encode("utf-8")) > MAX_DEFINITION_BYTES:
        raise InvalidRequest(f"the {syntax} grammar exceeds {MAX_DEFINITION_BYTES} bytes", param)
    source = (llguidance.LLMatcher.grammar_from_regex(definition) if syntax == "regex"
              else llguidance.LLMatcher.grammar_from_lark(definition))
    # NOTE: the constructor never raises for grammar errors or exhausted limits; it enters an error state
    matcher = llguidance.LLMatcher(_tokenizer(), source, log_level=0, limits=_limits())
    if matcher.is_error():
        reason = "; ".join(line.strip() for line in matcher.get_error().splitlines()
                           if line.strip() and not _QUOTE.match(line))[:MAX_ERROR_CHARS]
        raise InvalidRequest(f"invalid {syntax} grammar: {reason}", param)
    return Grammar(syntax, definition, matcher)  # type: ignore[arg-type]
