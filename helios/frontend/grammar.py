"""Grammars through llguidance: bounded compilation at admission, exact-byte validation, token masks.

Owns the one grammar compiler of helios, for two uses under the same bounds (a bad or oversized grammar is an
InvalidRequest before admission):
- Responses custom tools: a completed text is checked byte by byte against a Lark or regex grammar. Matching
  runs over a private 256-symbol byte vocabulary, so the verdict depends on the exact UTF-8 bytes, never on
  how a model tokenizer splits them.
- structured output: a JSON schema, Lark or regex grammar validated over the model's own vocabulary into
  llguidance's serialized grammar (the ConstraintSpec's text); the constraint owner (frontend/constraints.py)
  takes fresh matchers of it from here, compiled once per grammar text, and hands the engine token masks.
No torch; llguidance is imported here only.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Literal

from helios.frontend.sampling import InvalidRequest

GrammarSyntax = Literal["lark", "regex"]
SYNTAXES: tuple[str, ...] = ("lark", "regex")

MAX_DEFINITION_BYTES = 64 * 1024  # a grammar definition's UTF-8 size
MAX_GRAMMAR_SYMBOLS = 100_000  # llguidance max_grammar_size: symbols in all productions (default 500k)
MAX_LEXER_FUEL = 1_000_000  # llguidance initial_lexer_fuel: regex analysis work at compile time (~20 ms)
MAX_LEXER_STATES = 50_000  # llguidance max_lexer_states: ~1-2 kB each
MAX_ERROR_CHARS = 400  # compiler messages quote the grammar; keep a refusal readable
MAX_CACHED_GRAMMARS = 64  # compiled structured-output start states kept by grammar text (least recently used out)

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


def _source(syntax: str, definition: str, param: str | None) -> str:
    """llguidance's grammar source for a bounded Lark or regex definition."""
    import llguidance

    if not isinstance(definition, str) or not definition:
        raise InvalidRequest("a grammar needs a nonempty string definition", param)
    if len(definition.encode("utf-8")) > MAX_DEFINITION_BYTES:
        raise InvalidRequest(f"the {syntax} grammar exceeds {MAX_DEFINITION_BYTES} bytes", param)
    return (llguidance.LLMatcher.grammar_from_regex(definition) if syntax == "regex"
            else llguidance.LLMatcher.grammar_from_lark(definition))


def _matcher(tokenizer, source: str, what: str, param: str | None):
    """A matcher at its start state, under the bounds; a compile error is an InvalidRequest naming `what`."""
    import llguidance

    # NOTE: the constructor never raises for grammar errors or exhausted limits; it enters an error state
    matcher = llguidance.LLMatcher(tokenizer, source, log_level=0, limits=_limits())
    if matcher.is_error():
        reason = "; ".join(line.strip() for line in matcher.get_error().splitlines()
                           if line.strip() and not _QUOTE.match(line))[:MAX_ERROR_CHARS]
        raise InvalidRequest(f"invalid {what}: {reason}", param)
    return matcher


def compile_grammar(syntax: str, definition: str, param: str | None = None) -> Grammar:
    """Compile a Lark or regex definition under the bounds above; InvalidRequest names what is wrong."""
    if syntax not in SYNTAXES:
        raise InvalidRequest(f"unsupported grammar syntax {syntax!r}; use lark or regex", param)
    matcher = _matcher(_tokenizer(), _source(syntax, definition, param), f"{syntax} grammar", param)
    return Grammar(syntax, definition, matcher)  # type: ignore[arg-type]

# structured output's JSON: flexible whitespace between tokens, at most this much at a time (a model cannot
# fill its output limit with blank lines inside an object)
JSON_OPTIONS = {"whitespace_pattern": r"[\n\t ]{0,16}"}
OutputSyntax = Literal["json_schema", "lark", "regex"]


class OutputCompiler:
    """Validates structured-output grammars over a model vocabulary and hands out fresh llguidance matchers.

    The vocabulary (llguidance's LLTokenizer over the core's tokenizer.json, with the model's logit width
    and its end-of-generation ids: the grammar's end allows exactly those) is built on first use, once.
    Compiled start states are cached by grammar text (validation compiles; the constraint owner then copies).
    """

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]):
        self._tokenizer_json = tokenizer_json  # called once, on first use
        self._vocab_size = vocab_size
        self._eos_token_ids = list(eos_token_ids)
        self._vocabulary: Any = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[str, Any] = OrderedDict()  # grammar text -> matcher at its start state
        self._compiled_lock = threading.Lock()

    def _llg_tokenizer(self):
        with self._lock:
            if self._vocabulary is None:
                import llguidance

                try:
                    self._vocabulary = llguidance.LLTokenizer(
                        self._tokenizer_json(), n_vocab=self._vocab_size, eos_token=self._eos_token_ids or None)
                except Exception as e:  # NOTE: a tokenizer llguidance cannot read: no structured output here
                    raise InvalidRequest(f"this core's tokenizer cannot drive structured output: {e}") from None
            return self._vocabulary

    def prepare(self) -> None:
        """Build the vocabulary now (a server warms it in the background; a failure waits for a request)."""
        try:
            self._llg_tokenizer()
        except InvalidRequest:
            pass

    def matcher(self, grammar: str, what: str = "grammar", param: str | None = None):
        """A fresh matcher (this caller's own) at the start state of a serialized grammar; InvalidRequest when
        it does not compile under the bounds."""
        with self._compiled_lock:
            start = self._compiled.get(grammar)
            if start is not None:
                self._compiled.move_to_end(grammar)
        if start is None:
            start = _matcher(self._llg_tokenizer(), grammar, what, param)
            with self._compiled_lock:
                self._compiled[grammar] = start
                while len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
        return start.deep_copy()

    def compile(self, syntax: OutputSyntax, definition: Any, param: str | None = None) -> str:
        """llguidance's serialized grammar for a JSON schema (a dict), Lark or regex definition, validated over
        the model's vocabulary (a compile error is an InvalidRequest naming `param`)."""
        import llguidance

        if syntax == "json_schema":
            if not isinstance(definition, dict):
                raise InvalidRequest("a JSON schema must be an object", param)
            if len(json.dumps(definition, ensure_ascii=False).encode("utf-8")) > MAX_DEFINITION_BYTES:
                raise InvalidRequest(f"the JSON schema exceeds {MAX_DEFINITION_BYTES} bytes", param)
            try:
                source = llguidance.LLMatcher.grammar_from_json_schema(definition, defaults=JSON_OPTIONS)
            except (TypeError, ValueError, RuntimeError) as e:
                raise InvalidRequest(f"invalid JSON schema: {_first_line(str(e))[:MAX_ERROR_CHARS]}", param) from None
            self.matcher(source, "JSON schema", param)
            return source
        if syntax not in SYNTAXES:
            raise InvalidRequest(f"unsupported output grammar {syntax!r}", param)
        source = _source(syntax, definition, param)
        self.matcher(source, f"{syntax} grammar", param)
        return source
