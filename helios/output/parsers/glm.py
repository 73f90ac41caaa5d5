"""GLM tool calls: <tool_call>NAME<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>.

<tool_call> starts a call only when a function name and then <arg_key> or </tool_call> follow; other
mentions stay text. Values are verbatim text, typed by the declared schema; a missing </arg_value> is closed
by the next <arg_key> or the end of the call.
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers import scan
from helios.output.parsers.base import BaseToolParser, CallError, arguments_from_pairs

OPEN, CLOSE = "<tool_call>", "</tool_call>"
KEY_OPEN, KEY_CLOSE, VALUE_OPEN, VALUE_CLOSE = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class GlmToolParser(BaseToolParser):
    name = "glm"
    ends_reasoning = True  # like Qwen's <tool_call>: a recognized call ends reasoning
    text_markers = (OPEN,)
    call_close = CLOSE

    def classify(self, buf: str, in_block: bool):
        end, name = scan.bare_name(buf, scan.skip_ws(buf, len(OPEN)))
        pos = scan.any_literal(buf, scan.skip_ws(buf, end), (KEY_OPEN, CLOSE)) if end >= 0 else end
        v = scan.verdict(pos)
        return ("call", 0, name) if v == "ok" else (v, 1, None)

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        body = envelope[len(OPEN): len(envelope) - len(CLOSE)]
        first = body.find(KEY_OPEN)
        name = (body if first < 0 else body[:first]).strip()
        pairs: list[tuple[str, Any]] = []
        for chunk in body.split(KEY_OPEN)[1:] if first >= 0 else ():
            key_end = chunk.find(KEY_CLOSE)
            if key_end < 0:
                raise CallError("<arg_key> without </arg_key>")
            key = chunk[:key_end].strip()
            rest = chunk[key_end + len(KEY_CLOSE):].lstrip()
            if not rest.startswith(VALUE_OPEN):
                raise CallError(f"argument {key!r} without <arg_value>")
            value = rest[len(VALUE_OPEN):]
            end = value.find(VALUE_CLOSE)
            pairs.append((key, self.tools.convert(name, key, value if end < 0 else value[:end])))
        return name, arguments_from_pairs(pairs)
