"""Shared helpers of the parser tests: simulated tokenization as (token_id, text) pieces."""

from __future__ import annotations

import itertools
import json

from helios.core.manifest import ReasoningSyntax
from helios.output.events import ParseError, ReasoningDelta, TextDelta, ToolCall, coalesce
from helios.output.parsers import build, make_reasoning_parser, make_tool_parser
from helios.output.parsers.pipeline import OutputParser

WORD = 7  # the id of every ordinary token in these streams
THINK_OPEN, THINK_CLOSE = 151667, 151668  # single-token delimiters get their own ids


def think_syntax(starts_in_reasoning: bool = False, ids: bool = True, open_: str = "<think>",
                 close: str = "</think>", open_id: int | None = THINK_OPEN,
                 close_id: int | None = THINK_CLOSE) -> ReasoningSyntax:
    return ReasoningSyntax(open=open_, close=close, open_token_id=open_id if ids else None,
                           close_token_id=close_id if ids else None, starts_in_reasoning=starts_in_reasoning)


def counter_ids():
    n = itertools.count()
    return lambda: f"call_{next(n)}"


def parser(tool: str | None = None, reasoning: str | None = None, syntax: ReasoningSyntax | None = None,
           tools=None, **kw) -> OutputParser:
    if reasoning and syntax is None and reasoning != "dsml":
        rp = make_reasoning_parser(reasoning, None, kw.pop("starts_in_reasoning", False))
        tp = make_tool_parser(tool, _schemas(tools), **kw) if tool else None
        return OutputParser(rp, tp, counter_ids())
    if kw:
        rp = make_reasoning_parser(reasoning, syntax) if reasoning else None
        return OutputParser(rp, make_tool_parser(tool, _schemas(tools), **kw), counter_ids())
    return build(tool, reasoning, syntax, tools, new_call_id=counter_ids())


def _schemas(tools):
    from helios.output.tool_schema import ToolSchemas

    return tools if isinstance(tools, ToolSchemas) else ToolSchemas.from_tools(tools)


def run(p: OutputParser, stream, truncated: bool = False) -> list:
    """stream: str pieces (ordinary tokens) or (token_id, text) pairs; returns the coalesced events."""
    events = []
    for piece in stream:
        token_id, text = (WORD, piece) if isinstance(piece, str) else piece
        events += p.feed(token_id, text)
    events += p.finish(truncated)
    return coalesce(events)


def texts(events) -> list[tuple[str, str]]:
    """Events as (kind, text/name+args) tuples, call ids left out: easy to compare."""
    out = []
    for ev in events:
        if isinstance(ev, TextDelta):
            out.append(("text", ev.text))
        elif isinstance(ev, ReasoningDelta):
            out.append(("reasoning", ev.text))
        elif isinstance(ev, ToolCall):
            out.append(("call", ev.name, json.loads(ev.arguments)))
        elif isinstance(ev, ParseError):
            out.append(("error", ev.kind))
    return out


def tool(name: str, **props) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {k: ({"type": v} if isinstance(v, str) else v) for k, v in props.items()}}}}
