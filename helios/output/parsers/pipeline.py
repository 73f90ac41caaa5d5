"""The per-choice output parser: generated (token_id, text) pairs -> neutral semantic events.

Owns the composition of one reasoning parser and one tool-call parser: reasoning text bypasses the tool
parser unless the syntax recognizes calls in reasoning (Qwen), a recognized call ends reasoning, a call
envelope is opaque to the reasoning parser, call ids and indices, the namespace of a declared tool, the
count of reasoning tokens, and "errors are terminal". Feed it each generated token's exact text with
specials kept (a delimiter token's text is consumed). Pure Python.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from helios.output.events import Event, ReasoningDelta, TextDelta, ToolCall, ToolCallStart
from helios.output.parsers.base import BaseToolParser, CallStarted, Item, ParsedCall
from helios.output.parsers.reasoning import DelimiterReasoningParser, Piece


NO_TOKEN = -1  # the token id of text looked at again (never a delimiter id)


def random_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class OutputParser:
    """feed(token_id, text) -> events; finish(truncated) -> the last events. Either parser may be None."""

    def __init__(self, reasoning: DelimiterReasoningParser | None = None, tools: BaseToolParser | None = None,
                 new_call_id: Callable[[], str] = random_call_id):
        self.reasoning = reasoning
        self.tools = tools
        self._new_call_id = new_call_id
        self.num_calls = 0  # calls started (ToolCallStart emitted)
        self.num_reasoning_tokens = 0  # tokens generated while reasoning was open, delimiter tokens excluded
        self.failed = False
        self._region = reasoning.region if reasoning else "content"
        self._rescan = False  # a call began: the reasoning parser's look-ahead must be redone

    @property
    def in_reasoning(self) -> bool:
        return self._region == "reasoning"

    @property
    def tool_undecided(self) -> bool:
        """A tool opener is recognized but not yet confirmed, or a call is open (no forced reasoning close)."""
        return self.tools is not None and (self.tools.in_call or self.tools.is_undecided)

    def feed(self, token_id: int, text: str) -> list[Event]:
        events: list[Event] = []
        if self._stopped():
            return events  # NOTE: after an error, or once DSML closed its calls section, output is discarded
        if self.tools is not None and self.tools.in_call:  # NOTE: an open envelope is opaque: all of it is call text
            self._call_text(self._held() + text, events)
        elif self.reasoning is None:
            self._content(text, events)
        else:
            if self.reasoning.in_reasoning and token_id != self.reasoning.close_id:
                self.num_reasoning_tokens += 1
            self._pieces(self.reasoning.feed(token_id, text), events)
        return events

    def _stopped(self) -> bool:
        return self.failed or (self.tools is not None and self.tools.is_done)

    def _held(self) -> str:
        return self.reasoning.take_held() if self.reasoning is not None else ""

    def _pieces(self, pieces: list[Piece], events: list[Event]) -> None:
        assert self.reasoning is not None
        for i, (kind, text) in enumerate(pieces):
            if self._stopped():
                return
            if kind in ("open", "close"):
                if self.tools is not None:
                    self._items(self.tools.interrupt(), events)  # held tag text belongs to the old region
                self._region = "reasoning" if kind == "open" else "content"
                continue
            rest = self._route(kind, text, events)
            if rest or self._rescan or (self.tools is not None and self.tools.in_call):
                # NOTE: the reasoning parser scanned ahead under a state that no longer holds (a call began,
                # ended, or ended reasoning): what follows, delimiters included, is looked at again from here
                self._rescan = False
                after = rest + "".join(t for _, t in pieces[i + 1:]) + self._held()
                self.reasoning.region = self._region
                if self.tools is not None and self.tools.in_call:
                    self._call_text(after, events)
                elif after:
                    self._pieces(self.reasoning.feed(NO_TOKEN, after), events)
                return

    def _route(self, region: str, text: str, events: list[Event]) -> str:
        """Text of one region -> events; returns text after a call that closed in it (unread)."""
        if not text:
            return ""
        if region == "reasoning" and (self.tools is None or not self.tools.ends_reasoning):
            events.append(ReasoningDelta(text))
            return ""
        if self.tools is None:
            events.append(TextDelta(text))
            return ""
        items, rest = self.tools.feed(text)
        self._items(items, events)
        return rest

    def _content(self, text: str, events: list[Event]) -> None:
        while text and not self._stopped():
            text = self._route("content", text, events)

    def _call_text(self, text: str, events: list[Event]) -> None:
        """Text inside an open envelope; what follows its end goes back through the reasoning parser."""
        assert self.tools is not None
        items, rest = self.tools.feed(text)
        self._items(items, events)
        self._rescan = False
        if rest and not self._stopped():
            if self.reasoning is None:
                self._content(rest, events)
            else:
                self.reasoning.region = self._region
                self._pieces(self.reasoning.feed(NO_TOKEN, rest), events)

    def _items(self, items: list[Item], events: list[Event]) -> None:
        for item in items:
            if isinstance(item, str):
                if item:
                    events.append(ReasoningDelta(item) if self._region == "reasoning" else TextDelta(item))
            elif isinstance(item, CallStarted):
                self._rescan = True
                if self._region == "reasoning":
                    self._end_reasoning(events)
                events.append(ToolCallStart(self.num_calls, item.name))
                self.num_calls += 1
            elif isinstance(item, ParsedCall):
                spec = self.tools.tools.lookup(item.name) if self.tools is not None else None
                events.append(ToolCall(self.num_calls - 1, self._new_call_id(), item.name, item.arguments,
                                       spec.namespace if spec is not None else None))
            else:
                events.append(item)
                self.failed = True
                return

    def _end_reasoning(self, events: list[Event]) -> None:
        """A call recognized inside reasoning ends it (Qwen's <tool_call>); _pieces re-scans what follows."""
        assert self.reasoning is not None and self.tools is not None
        self.reasoning.end_reasoning()
        self._region = "content"

    def finish(self, truncated: bool = False) -> list[Event]:
        """End of output; truncated: the output limit ended it (open envelopes are omitted, not errors)."""
        events: list[Event] = []
        if self._stopped():
            return events
        while not self._stopped():  # release what the reasoning parser holds; each round holds less
            if self.tools is not None and self.tools.in_call:
                held = self._held()
                if not held:
                    break
                self._call_text(held, events)
            elif self.reasoning is not None:
                pieces = self.reasoning.finish()
                if not pieces:
                    break
                self._pieces(pieces, events)
            else:
                break
        if self.tools is not None and not self._stopped():
            self._items(self.tools.finish(truncated), events)
        return events
