"""One choice's parsed output: OutputDeltas -> parser events -> validators -> ordered blocks and block events.

Owns the per-choice pipeline every generating protocol shares: the core's OutputParser (helios.output.parsers),
the CustomInputValidator (Responses custom tools), the ToolChoiceValidator and the EventAccumulator; a choice
whose request parses nothing takes the text-only OutputAccumulator. `OutputSpec` is the neutral description
of what a request parses, built by helios.frontend. A failure is a terminal `ParseError`, which the server
encodes. Pure Python: must not import the server or the frontend.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from helios.output.accumulator import BlockEvent, OutputAccumulator, OutputBlock
from helios.output.custom_tools import CustomInputValidator, Matcher
from helios.output.event_accumulator import EventAccumulator
from helios.output.events import ParseError, ToolCall
from helios.output.processor import OutputDelta
from helios.output.tool_choice import ToolChoiceMode, ToolChoiceValidator
from helios.output.tool_schema import ToolSchemas


@dataclass(frozen=True)
class OutputSpec:
    """How one request's choices parse their output (None on a choice: the text-only path)."""

    tool_parser: str | None
    reasoning_parser: str | None
    syntax: Any  # ReasoningSyntax | None, with starts_in_reasoning decided for this prompt
    tools: ToolSchemas | None = None  # the presented tools while calls are parsed; None: calls are not parsed
    mode: ToolChoiceMode = "auto"  # tool_choice, "auto" while calls are not parsed
    names: tuple[str, ...] = ()  # every declared tool name (presented spelling)
    named: str | None = None
    parallel: bool = True
    custom_grammars: Mapping[str, Matcher | None] = field(default_factory=dict)  # custom tools' grammars
    new_call_id: Callable[[], str] | None = None  # the protocol's call id spelling (None: the parser's)

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None


class ChoiceOutput:
    """One choice's ordered output: add(delta) -> block events, close() at the end; `error` is terminal."""

    def __init__(self, spec: OutputSpec | None):
        self.spec = spec
        self.error: ParseError | None = None
        if spec is None:
            self._text = OutputAccumulator()
            return
        from helios.output.parsers import build

        self.parser = build(spec.tool_parser, spec.reasoning_parser, spec.syntax, spec.tools,
                            parse_tools=spec.parses_tools, new_call_id=spec.new_call_id)
        # NOTE: custom inputs are checked first, so a call that fails its grammar never counts as completed
        self.custom = CustomInputValidator(spec.custom_grammars)
        self.validator = ToolChoiceValidator(spec.mode, list(spec.names), spec.named, spec.parallel)
        self.acc = EventAccumulator()
        self._finished = False

    def add(self, delta: OutputDelta) -> list[BlockEvent]:
        if self.spec is None:
            return self._text.add(delta)
        if self.error is not None or self._finished:
            return []
        events = []
        for token_id, text in delta.tokens:
            events += self.parser.feed(token_id, text)
        natural = delta.finished and delta.finish_reason in ("stop", "length")
        if natural:
            events += self.parser.finish(truncated=delta.finish_reason == "length")
        events = self.validator.filter(self.custom.filter(events))
        if natural and not self.validator.failed:
            events += self.validator.finish()
        if delta.finished:
            self._finished = True
        out = self.acc.add(events, delta.entries)
        self.error = self.acc.error
        return out

    def close(self) -> list[BlockEvent]:
        return self._view.close()

    @property
    def _view(self) -> EventAccumulator:
        return self._text if self.spec is None else self.acc

    @property
    def blocks(self) -> list[OutputBlock]:
        return self._view.blocks

    @property
    def text(self) -> str:
        return self._view.text

    @property
    def reasoning(self) -> str | None:
        """The reasoning text (None when there is none)."""
        return None if self.spec is None else (self.acc.reasoning or None)

    @property
    def num_tool_calls(self) -> int:
        return self._view.num_tool_calls

    def tool_call(self, block_index: int) -> ToolCall | None:
        return None if self.spec is None else self.acc.calls.get(block_index)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [] if self.spec is None else self.acc.tool_calls

    @property
    def num_reasoning_tokens(self) -> int:
        return 0 if self.spec is None else self.parser.num_reasoning_tokens

    def failure_message(self) -> str | None:
        """Why the output is not a valid answer (it broke tool_choice or could not be parsed), or None."""
        if self.error is None:
            return None
        return f"the model output is not a valid answer ({self.error.kind}): {self.error.message}"


def parsed(spec: OutputSpec | None, delta: OutputDelta) -> ChoiceOutput:
    """A buffered choice's whole output (one delta carrying every token) through its parsers, closed."""
    out = ChoiceOutput(spec)
    out.add(delta)
    out.close()
    return out
