"""The ordered output accumulator: semantic events -> ordered blocks (text, reasoning, tool calls) + block events.

Folds TextDelta / ReasoningDelta / ToolCall events into OutputBlocks and the BlockEvents that announce them, so
every encoder (Chat, Messages, Responses; buffered and SSE) reads one ordered output and the buffered and
streamed forms never disagree. A tool call is one block published whole (start, one delta with its arguments,
stop); on the parsed path, whitespace that would open a block alone (the newline between two envelopes) waits
for text and is dropped when a call or the end comes first; the first ParseError is kept in `error` and ends
accumulation. The text-only path (helios.output.accumulator.OutputAccumulator) is this accumulator fed answer
text alone. Pure Python.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from typing import Literal

from msgspec import Struct, field

from helios.output.events import Event, ParseError, ReasoningDelta, TextDelta, ToolCall
from helios.output.processor import TokenEntry

BlockKind = Literal["text", "reasoning", "tool_call"]


class OutputBlock(Struct, kw_only=True):
    kind: BlockKind
    text: str = ""  # answer or reasoning text; a tool call's JSON arguments
    entries: list[TokenEntry] = field(default_factory=list)  # logprob entries whose first byte is in this block
    name: str | None = None  # tool calls
    call_id: str | None = None


class BlockEvent(Struct, kw_only=True):
    kind: Literal["start", "delta", "stop"]
    index: int
    block: OutputBlock
    text: str = ""
    entries: list[TokenEntry] = field(default_factory=list)


class EventAccumulator:
    """add(events, entries) -> block events in order; close() ends the open block; `blocks` is the buffered view."""

    def __init__(self, holds_blank: bool = True) -> None:
        self.blocks: list[OutputBlock] = []
        # False: whitespace opens a text block like any text (the text-only path shows exactly what was generated)
        self.holds_blank = holds_blank
        self.calls: dict[int, ToolCall] = {}  # block index -> the call (namespace, index) behind a tool block
        self.error: ParseError | None = None
        self._open: OutputBlock | None = None
        # NOTE: entries of tokens whose text is still buffered (an envelope, a delimiter) wait for the next block text
        self._pending: list[TokenEntry] = []
        self._blank: tuple[BlockKind, str] | None = None  # whitespace that would open a block: kept until text

    def _start(self, kind: BlockKind, out: list[BlockEvent], **fields) -> OutputBlock:
        self._stop(out)
        block = OutputBlock(kind=kind, **fields)
        self.blocks.append(block)
        self._open = block
        out.append(BlockEvent(kind="start", index=len(self.blocks) - 1, block=block))
        return block

    def _stop(self, out: list[BlockEvent]) -> None:
        if self._open is not None:
            out.append(BlockEvent(kind="stop", index=len(self.blocks) - 1, block=self._open))
            self._open = None

    def _delta(self, block: OutputBlock, text: str, out: list[BlockEvent]) -> None:
        entries, self._pending = self._pending, []
        block.text += text
        block.entries += entries
        out.append(BlockEvent(kind="delta", index=len(self.blocks) - 1, block=block, text=text, entries=entries))

    def add(self, events: Iterable[Event], entries: Sequence[TokenEntry] = ()) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if self.error is not None:
            return out
        self._pending += entries
        for ev in events:
            if isinstance(ev, (TextDelta, ReasoningDelta)):
                kind: BlockKind = "text" if isinstance(ev, TextDelta) else "reasoning"
                if self._open is not None and self._open.kind == kind:
                    if ev.text:
                        self._delta(self._open, ev.text, out)
                    continue
                text = self._blank[1] + ev.text if self._blank and self._blank[0] == kind else ev.text
                self._blank = None
                if not text:
                    continue
                if text.isspace() and self.holds_blank:  # NOTE: a parsed block never opens with whitespace alone
                    self._blank = (kind, text)
                    continue
                self._delta(self._start(kind, out), text, out)
            elif isinstance(ev, ToolCall):
                self._blank = None
                block = self._start("tool_call", out, name=ev.name, call_id=ev.id)
                self.calls[len(self.blocks) - 1] = ev
                self._delta(block, ev.arguments, out)
                self._stop(out)
            elif isinstance(ev, ParseError):
                self.error = ev
                self._stop(out)
                break
            # ToolCallStart: nothing to show; envelopes are published whole
        return out

    def close(self) -> list[BlockEvent]:
        """End of output: stop the open block; entries of tokens that produced no text are dropped."""
        out: list[BlockEvent] = []
        self._stop(out)
        self._pending, self._blank = [], None
        return out

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def reasoning(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "reasoning")

    @property
    def tool_calls(self) -> list[ToolCall]:
        return list(self.calls.values())

    @property
    def num_tool_calls(self) -> int:
        return len(self.calls)
