"""Kimi tool calls: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>.

The section opener always starts; each call's arguments are a JSON object; NAME drops the "functions."
prefix and the ":IDX" suffix of Kimi's call id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from helios.output.parsers.base import BaseToolParser, CallError

OPEN, CLOSE = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_OPEN, ARGS, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


class KimiToolParser(BaseToolParser):
    name = "kimi"
    text_markers = (OPEN,)
    block_markers = (CALL_OPEN, CLOSE)
    call_close = CALL_CLOSE

    def classify(self, buf: str, in_block: bool):
        if not in_block:
            return "block", len(OPEN), None
        if buf.startswith(CLOSE):
            return "close", len(CLOSE), None
        return "call", 0, None

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        body = envelope[len(CALL_OPEN): len(envelope) - len(CALL_CLOSE)]
        head, sep, raw = body.partition(ARGS)
        if not sep:
            raise CallError(f"missing {ARGS}")
        name = head.strip().removeprefix("functions.")
        stem, colon, idx = name.rpartition(":")
        if colon and idx.isdigit():
            name = stem
        try:
            args = msgspec.json.decode(raw.strip()) if raw.strip() else {}
        except msgspec.DecodeError as e:
            raise CallError(f"invalid JSON arguments: {e}") from None
        if not isinstance(args, dict):
            raise CallError("arguments are not a JSON object")
        return name, args
