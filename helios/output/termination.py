"""The terminal cause of one choice, decided once from the pipeline's finish record.

Every protocol maps this one cause to its own finish reason (spec: "The terminal event carries a
termination cause"); the table lives beside the protocols in helios.server.generation. Pure Python.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Literal

Cause = Literal["eos", "stop_token", "stop_string", "length", "tool_calls", "abort", "error"]


def termination_cause(finish_reason: str | None, stop_reason: object, eos_token_ids: Collection[int],
                      num_tool_calls: int = 0) -> Cause:
    """finish_reason/stop_reason as OutputProcessor records them -> the neutral cause.

    NOTE: an output limit wins over completed tool calls; a matched string stop is the user's stop, so it
    wins over tool calls too; any other natural end with completed calls is a tool-call answer."""
    if finish_reason in ("abort", "error"):
        return finish_reason  # type: ignore[return-value]
    if finish_reason == "length":
        return "length"
    if isinstance(stop_reason, str):
        return "stop_string"
    if num_tool_calls:
        return "tool_calls"
    if stop_reason is None or (isinstance(stop_reason, int) and stop_reason in eos_token_ids):
        return "eos"
    return "stop_token"
