"""The ordered output accumulator: neutral deltas -> ordered blocks (text, reasoning, tool calls) + block events.

Protocol encoders use the same accumulated blocks for buffered responses and the block events for SSE, so
the two never disagree. This accumulator takes answer text only (a core or request that parses nothing); the
parsed path (reasoning, tool calls) folds parser events through helios.output.event_accumulator. Pure Python.
"""

from __future__ import annotations

from typing import Literal

from msgspec import Struct, field

from helios.output.processor import OutputDelta, TokenEntry

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


class OutputAccumulator:
    """add(delta) -> block events in order; close() ends the open block. `blocks` is the buffered view."""

    def __init__(self) -> None:
        self.blocks: list[OutputBlock] = []
        self._open: OutputBlock | None = None
        # NOTE: entries wait for the text their token's first byte lands in (incomplete UTF-8 is held back)
        self._pending: list[TokenEntry] = []

    def _start(self, kind: BlockKind, events: list[BlockEvent]) -> OutputBlock:
        self._stop(events)
        block = OutputBlock(kind=kind)
        self.blocks.append(block)
        self._open = block
        events.append(BlockEvent(kind="start", index=len(self.blocks) - 1, block=block))
        return block

    def _stop(self, events: list[BlockEvent]) -> None:
        if self._open is not None:
            events.append(BlockEvent(kind="stop", index=len(self.blocks) - 1, block=self._open))
            self._open = None

    def add(self, delta: OutputDelta) -> list[BlockEvent]:
        events: list[BlockEvent] = []
        self._pending += delta.entries
        if delta.text:
            block = self._open if self._open is not None and self._open.kind == "text" else None
            if block is None:
                block = self._start("text", events)
            entries, self._pending = self._pending, []
            block.text += delta.text
            block.entries += entries
            events.append(BlockEvent(kind="delta", index=len(self.blocks) - 1, block=block, text=delta.text,
                                     entries=entries))
        return events

    def close(self) -> list[BlockEvent]:
        """End of output: stop the open block; entries of tokens that produced no text are dropped."""
        events: list[BlockEvent] = []
        self._stop(events)
        self._pending = []
        return events

    @property
    def text(self) -> str:
        return "".join(b.text for b in self.blocks if b.kind == "text")

    @property
    def num_tool_calls(self) -> int:
        return sum(1 for b in self.blocks if b.kind == "tool_call")
