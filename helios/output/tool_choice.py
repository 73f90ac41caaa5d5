"""Output validation for tool_choice and parallel_tool_calls: parser events in -> events a protocol may emit.

Owns the spec's rules: auto passes every parseable call (undeclared names too); required needs at least one
completed call to a declared tool; a named choice hides answer text, fails a call to another tool before it
is emitted and needs one completed call; parallel_tool_calls false fails when a second call begins, before it
is emitted. Violations become ParseError(kind="tool_choice"), which is terminal. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

from helios.output.events import Event, ParseError, TextDelta, ToolCall, ToolCallStart

ToolChoiceMode = Literal["auto", "none", "required", "named"]


class ToolChoiceValidator:
    """filter(events) -> the events to emit; finish() -> a terminal ParseError when a call was required."""

    def __init__(self, mode: ToolChoiceMode = "auto", declared: Iterable[str] = (), named: str | None = None,
                 parallel_tool_calls: bool = True):
        if mode == "named" and not named:
            raise ValueError("a named tool_choice needs the tool's name")
        self.mode = mode
        self.declared = frozenset(declared) | ({named} if named else frozenset())
        self.named = named
        self.parallel = parallel_tool_calls
        self.num_started = 0
        self.num_completed_declared = 0
        self.failed = False

    def _fail(self, message: str) -> ParseError:
        self.failed = True
        return ParseError("tool_choice", message)

    def filter(self, events: Iterable[Event]) -> list[Event]:
        out: list[Event] = []
        for ev in events:
            if self.failed:
                break
            if isinstance(ev, ParseError):
                self.failed = True
                out.append(ev)
            elif isinstance(ev, TextDelta):
                if self.mode != "named":  # NOTE: named selection omits answer text (usage still counts it)
                    out.append(ev)
            elif isinstance(ev, ToolCallStart):
                self.num_started += 1
                if not self.parallel and self.num_started > 1:
                    out.append(self._fail("parallel_tool_calls is false but the model began a second tool call"))
                elif self.mode == "named" and ev.name is not None and ev.name != self.named:
                    out.append(self._fail(f"tool_choice names {self.named!r} but the model called {ev.name!r}"))
                else:
                    out.append(ev)
            elif isinstance(ev, ToolCall):
                if self.mode == "named" and ev.name != self.named:
                    out.append(self._fail(f"tool_choice names {self.named!r} but the model called {ev.name!r}"))
                    continue
                if ev.name in self.declared:
                    self.num_completed_declared += 1
                out.append(ev)
            else:
                out.append(ev)
        return out

    def finish(self) -> list[Event]:
        """At the end of output (natural or truncated): required/named modes without a completed call fail."""
        if self.failed or self.mode not in ("required", "named") or self.num_completed_declared:
            return []
        return [self._fail("tool_choice requires a tool call, but the output contains no completed call"
                           + ("" if self.mode == "named" else " to a declared tool"))]
