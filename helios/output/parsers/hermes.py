"""Hermes-style JSON calls: <tool_call>{"name": NAME, "arguments": {...}}</tool_call> (Qwen2.5/3, Nemotron-H).

<tool_call> starts a call only when a JSON object follows ('{' after optional whitespace); other mentions
stay text. "parameters" is accepted for "arguments"; arguments given as a JSON string must hold an object.
"""

from __future__ import annotations

from typing import Any

import msgspec

from helios.output.parsers import scan
from helios.output.parsers.base import BaseToolParser, CallError

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(BaseToolParser):
    name = "hermes"
    text_markers = (OPEN,)
    call_close = CLOSE

    def classify(self, buf: str, in_block: bool):
        v = scan.verdict(scan.literal(buf, scan.skip_ws(buf, len(OPEN)), "{"))
        return ("call", 0, None) if v == "ok" else (v, 1, None)

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        body = envelope[len(OPEN): len(envelope) - len(CLOSE)].strip()
        try:
            obj = msgspec.json.decode(body)
        except msgspec.DecodeError as e:
            raise CallError(f"invalid JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            raise CallError('expected {"name": ..., "arguments": {...}}')
        args = obj.get("arguments", obj.get("parameters"))
        if args is None:
            args = {}
        if isinstance(args, str):
            try:
                args = msgspec.json.decode(args) if args.strip() else {}
            except msgspec.DecodeError as e:
                raise CallError(f"invalid JSON arguments: {e}") from None
        if not isinstance(args, dict):
            raise CallError("arguments are not a JSON object")
        return obj["name"].strip(), args
