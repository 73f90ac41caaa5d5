"""Completed calls to Responses custom tools: the presented {"input": string} object and its grammar.

A custom tool reaches the model as a JSON function with one string argument, `input`; this filter checks
each completed call to one before it is emitted: the arguments must be exactly {"input": <string>} and,
when the tool declares a grammar, the string's exact UTF-8 bytes must be a sentence of it. A violation
becomes ParseError(invalid_call), which is terminal: the call is never emitted and nothing is repaired.
Pure Python + msgspec; the grammar is any object with match(bytes) -> str | None (helios.frontend.grammar).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

import msgspec

from helios.output.events import Event, ParseError, ToolCall

INPUT = "input"  # the one argument of a presented custom tool


class Matcher(Protocol):
    syntax: str

    def match(self, data: bytes) -> str | None: ...


def custom_input(arguments: str) -> str:
    """The input string of a validated custom call's arguments ({"input": string})."""
    return msgspec.json.decode(arguments)[INPUT]


class CustomInputValidator:
    """filter(events) -> events; `grammars` maps each presented custom tool name to its grammar (None: text)."""

    def __init__(self, grammars: Mapping[str, Matcher | None]):
        self.grammars = dict(grammars)
        self.failed = False

    def _check(self, call: ToolCall) -> ParseError | None:
        try:
            args = msgspec.json.decode(call.arguments)
        except msgspec.DecodeError:
            args = None
        if not isinstance(args, dict) or set(args) != {INPUT} or not isinstance(args[INPUT], str):
            return ParseError("invalid_call", f"custom tool {call.name!r} takes exactly one string argument "
                                              f"{INPUT!r}; the model passed {call.arguments[:200]}")
        grammar = self.grammars[call.name]
        if grammar is not None and (why := grammar.match(args[INPUT].encode("utf-8"))) is not None:
            return ParseError("invalid_call", f"the input of custom tool {call.name!r} does not match its "
                                              f"{grammar.syntax} grammar: {why}")
        return None

    def filter(self, events: Iterable[Event]) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            if self.failed:
                break
            if isinstance(ev, ToolCall) and ev.name in self.grammars and (err := self._check(ev)) is not None:
                ev = err
            if isinstance(ev, ParseError):
                self.failed = True
            out.append(ev)
        return out
