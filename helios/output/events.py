"""Neutral semantic output events: what the reasoning and tool-call parsers say about generated text.

Owns the event vocabulary every protocol encoder reads (through helios.output.event_accumulator):
TextDelta, ReasoningDelta, ToolCallStart, ToolCall, ParseError. Pure data; imports only msgspec.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct

# NOTE: arguments are JSON objects bounded to 8 MiB of UTF-8 (spec: "Conversation and tool semantics").
MAX_ARGUMENT_BYTES = 8 * 1024 * 1024

ParseErrorKind = Literal[
    "incomplete_call",  # a recognized call (or a still-undecided tag) at natural completion
    "invalid_call",  # malformed envelope, empty name, invalid argument syntax, duplicate argument names
    "too_large",  # arguments over MAX_ARGUMENT_BYTES
    "tool_choice",  # the output broke tool_choice / parallel_tool_calls (helios.output.tool_choice)
]


class TextDelta(Struct, frozen=True, tag="text"):
    """Answer text, in generation order."""

    text: str


class ReasoningDelta(Struct, frozen=True, tag="reasoning"):
    """Readable reasoning text, in generation order."""

    text: str


class ToolCallStart(Struct, frozen=True, tag="tool_call_start"):
    """A tool envelope was recognized and is being buffered; nothing of it is shown yet.

    Encoders emit nothing for it: the validator uses it to fail a second call before it is emitted."""

    index: int  # 0-based call index in this output
    name: str | None = None  # known when the syntax puts the name in the opener (Qwen, GLM, MiniMax, ...)


class ToolCall(Struct, frozen=True, tag="tool_call"):
    """A complete call: the envelope closed and its arguments parsed into a JSON object."""

    index: int
    id: str
    name: str  # the generated name, as the template presented it (a namespaced tool reads namespace__name)
    arguments: str  # JSON object text (compact, UTF-8 <= MAX_ARGUMENT_BYTES)
    namespace: str | None = None  # the declared namespace of a namespaced tool, else None


class ParseError(Struct, frozen=True, tag="parse_error"):
    """The output cannot be published as a valid answer: terminal; nothing follows it."""

    kind: ParseErrorKind
    message: str


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCall | ParseError


def coalesce(events: list[Event]) -> list[Event]:
    """Merge adjacent text (and adjacent reasoning) deltas, drop empty ones: the split-independent view."""
    out: list[Event] = []
    for ev in events:
        if isinstance(ev, (TextDelta, ReasoningDelta)):
            if not ev.text:
                continue
            if out and type(out[-1]) is type(ev):
                out[-1] = type(ev)(out[-1].text + ev.text)  # type: ignore[union-attr]
                continue
        out.append(ev)
    return out
