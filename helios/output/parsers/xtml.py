"""Kimi K3's XTML output: the think / response / tools channels of one assistant message -> neutral events.

XTML elements are built from control tokens: `<|open|>NAME attrs<|sep|>` opens an element, `<|close|>NAME<|sep|>`
closes it, `<|end_of_msg|>` (the EOS) ends the message. An assistant message holds, in this order:
  <|open|>think<|sep|>REASONING<|close|>think<|sep|>      (the generation prompt already opened it)
  <|open|>response<|sep|>ANSWER<|close|>response<|sep|>
  <|open|>tools<|sep|>
    <|open|>call tool="NAME" index="1"<|sep|>
      <|open|>argument key="K" type="string|number|boolean|null|object|array"<|sep|>V<|close|>argument<|sep|>
      ... (or one <|open|>json type="object"<|sep|>{JSON object}<|close|>json<|sep|> holding all arguments)
    <|close|>call<|sep|> ...
  <|close|>tools<|sep|>
  <|close|>message<|sep|>
Two parsers, on the literals of helios.core.kimi_encoding (the encoder that teaches them):
- `XtmlReasoningParser` ("xtml"): the channels. A think opener enters reasoning (consumed when already in it); the
  think close, a response opener or close, or a message close leave it (a response-only output skips think); a
  tools opener in reasoning ends it and goes on as answer text, for the tool parser. Response and message wrappers
  are consumed, never shown. Every marker spans several tokens, so all are matched as text (spec).
- `XtmlToolParser` ("xtml"): the tools channel. Its opener always starts a block; each call is published when its
  `<|close|>call<|sep|>` arrives; closing the block ends parsed output (the channel is the message's last
  element, what follows is discarded). A string value is the raw text; other typed values are JSON (invalid JSON
  falls back to schema-guided conversion, as DSML's string="false"); an absent or unknown type is schema-guided.
  Attribute values unescape &quot; and &amp;. Nonempty tool and argument names, unique argument names (spec).
  A missing argument close, text other than arguments inside a call, or a json block that is not one JSON object
  is an invalid call. Pure Python.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from helios.core.kimi_encoding import (ARGUMENT_CLOSE, CALL_CLOSE, CALL_OPEN, CLOSE, JSON_CLOSE, MESSAGE_CLOSE, OPEN,
                                       RESPONSE_CLOSE, RESPONSE_OPEN, THINK_CLOSE, THINK_OPEN, TOOLS_CLOSE, TOOLS_OPEN,
                                       unescape_attr)
from helios.core.manifest import ReasoningSyntax
from helios.output.parsers.base import CallError, arguments_from_pairs, earliest, hold_partial
from helios.output.parsers.reasoning import DelimiterReasoningParser, Piece
from helios.output.parsers.sections import SectionToolParser
from helios.output.tool_schema import ToolSchemas

# region -> {marker: what it does there}: "open"/"close" switch the region (or keep it) and consume the marker;
# "end" ends reasoning and leaves the marker in the answer text (the tools opener, for the tool parser)
_ACTIONS: dict[str, dict[str, str]] = {
    "reasoning": {THINK_OPEN: "open", THINK_CLOSE: "close", RESPONSE_OPEN: "close", RESPONSE_CLOSE: "close",
                  MESSAGE_CLOSE: "close", TOOLS_OPEN: "end"},
    "content": {THINK_OPEN: "open", THINK_CLOSE: "close", RESPONSE_OPEN: "close", RESPONSE_CLOSE: "close",
                MESSAGE_CLOSE: "close"},
}


class XtmlReasoningParser(DelimiterReasoningParser):
    """The think / response channels; the probe's syntax only says whether output starts in reasoning."""

    name = "xtml"
    default_open, default_close = THINK_OPEN, THINK_CLOSE
    match_token_ids = False

    def __init__(self, syntax: ReasoningSyntax | None = None, starts_in_reasoning: bool | None = None):
        super().__init__(syntax, starts_in_reasoning)
        self.open, self.close = THINK_OPEN, THINK_CLOSE  # whatever the core's probe recorded

    def feed(self, token_id: int, text: str) -> list[Piece]:
        return self._feed_text(text)

    def _feed_text(self, text: str) -> list[Piece]:
        # NOTE: a consumed marker travels as an "open"/"close" piece carrying its text (also when the region
        # does not change), so the pipeline can re-read it when a call began earlier in the same pieces
        buf, self._held = self._held + text, ""
        out: list[Piece] = []
        while buf:
            actions = _ACTIONS[self.region]
            i = earliest(buf, tuple(actions))
            if i < 0:
                ready, self._held = hold_partial(buf, tuple(actions))
                if ready:
                    out.append((self.region, ready))
                return out
            if i:
                out.append((self.region, buf[:i]))
            marker = next(m for m in actions if buf.startswith(m, i))
            action = actions[marker]
            if action == "end":
                out.append(("close", ""))
                self.region, buf = "content", buf[i:]
                continue
            out.append((action, marker))  # type: ignore[arg-type]
            self.region = "reasoning" if action == "open" else "content"
            buf = buf[i + len(marker):]
        return out

    def finish(self) -> list[Piece]:
        """A held partial marker that already began with a control token is markup cut short, not text."""
        held = self.take_held()
        return [(self.region, held)] if held and not held.startswith((OPEN, CLOSE)) else []


_ELEMENT = re.compile(r'<\|open\|>(call|argument|json)((?:\s+[A-Za-z_][\w-]*="[^"]*")*)\s*<\|sep\|>')
_ATTR = re.compile(r'([A-Za-z_][\w-]*)="([^"]*)"')


def _attrs(text: str) -> dict[str, str]:
    return {k: unescape_attr(v) for k, v in _ATTR.findall(text)}


class XtmlToolParser(SectionToolParser):
    name = "xtml"
    section_open, section_close = TOOLS_OPEN, TOOLS_CLOSE
    call_open, call_close = CALL_OPEN, CALL_CLOSE
    close_ends_output = True

    def parse_body(self, body: str) -> tuple[str, dict[str, Any]]:
        """One envelope, `<|open|>call ...<|sep|>` through `<|close|>call<|sep|>`."""
        head = _ELEMENT.match(body)
        if head is None or head.group(1) != "call":
            raise CallError("expected <|open|>call tool=\"...\"<|sep|>")
        name = _attrs(head.group(2)).get("tool", "")
        return name, read_arguments(body[head.end(): len(body) - len(CALL_CLOSE)], name, self.tools)


def read_arguments(body: str, tool: str, tools: ToolSchemas) -> dict[str, Any]:
    """A call's elements: argument elements in order, or one json element holding the whole object."""
    pairs: list[tuple[str, Any]] = []
    whole: dict[str, Any] | None = None
    pos = _skip_space(body, 0)
    while pos < len(body):
        m = _ELEMENT.match(body, pos)
        if m is None or m.group(1) == "call":
            raise CallError(f"unexpected text in a call: {body[pos:pos + 40]!r}")
        close = ARGUMENT_CLOSE if m.group(1) == "argument" else JSON_CLOSE
        end = body.find(close, m.end())
        if end < 0:
            raise CallError(f"{m.group(1)} element without {close}")
        attrs, raw = _attrs(m.group(2)), body[m.end():end]
        if m.group(1) == "json":
            if whole is not None or pairs:
                raise CallError("a json element must hold all of a call's arguments")
            whole = _json_object(raw)
        else:
            if whole is not None:
                raise CallError("a json element must hold all of a call's arguments")
            key = attrs.get("key", "")
            pairs.append((key, _value(raw, attrs.get("type"), tool, key, tools)))
        pos = _skip_space(body, end + len(close))
    return whole if whole is not None else arguments_from_pairs(pairs)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _value(raw: str, kind: str | None, tool: str, key: str, tools: ToolSchemas) -> Any:
    if kind == "string":
        return raw
    if kind in ("number", "boolean", "null", "object", "array"):
        try:
            return msgspec.json.decode(raw.strip())
        except msgspec.DecodeError:
            pass  # NOTE: non-strict, as DSML's string="false": the schema, then the text itself
    return tools.convert(tool, key, raw)


def _json_object(raw: str) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(raw.strip())
    except msgspec.DecodeError as e:
        raise CallError(f"invalid JSON arguments: {e}") from None
    if not isinstance(value, dict):
        raise CallError("json arguments are not a JSON object")
    return value
