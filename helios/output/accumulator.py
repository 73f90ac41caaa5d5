"""The text-only output path: answer text -> the ordered blocks and block events of the one accumulator.

A core or request that parses nothing (no reasoning parser, no tools) still gives its encoders the same
OutputBlock / BlockEvent view as the parsed path: this is helios.output.event_accumulator's EventAccumulator
fed each delta's text as one TextDelta, with whitespace shown as generated. Pure Python.
"""

from __future__ import annotations

from helios.output.event_accumulator import BlockEvent, BlockKind, EventAccumulator, OutputBlock
from helios.output.events import TextDelta
from helios.output.processor import OutputDelta

__all__ = ["BlockEvent", "BlockKind", "OutputAccumulator", "OutputBlock"]


class OutputAccumulator(EventAccumulator):
    """add(delta) -> block events in order; close() ends the open block. `blocks` is the buffered view."""

    def __init__(self) -> None:
        super().__init__(holds_blank=False)

    def add(self, delta: OutputDelta) -> list[BlockEvent]:  # type: ignore[override]
        return super().add([TextDelta(delta.text)] if delta.text else [], delta.entries)
