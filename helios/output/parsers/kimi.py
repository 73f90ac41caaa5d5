"""Kimi tool calls: <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX
<|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>.

The section opener always starts; each call's arguments are a JSON object; NAME drops the "functions."
prefix and the ":IDX" suffix of Kimi's call id.
"""

from __future__ import annotations

from typing import Any

import msgspec

from helios.output.parsers.base import CallError
from helios.output.parsers.sections import SectionToolParser

ARGS = "<|tool_call_argument_begin|>"


class KimiToolParser(SectionToolParser):
    name = "kimi"
    section_open, section_close = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    call_open, call_close = "<|tool_call_begin|>", "<|tool_call_end|>"
    wrapped = True

    def parse_body(self, body: str) -> tuple[str, dict[str, Any]]:
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
