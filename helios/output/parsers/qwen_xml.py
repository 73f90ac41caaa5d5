"""Qwen function tags: <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>.

A <tool_call> or <function= starts a call only when a <function=NAME> header and then a <parameter= or
</function> tag follow (a quoted tag in prose stays text); the outer tags may be omitted; a call completes
at </function>, even inside reasoning, which it ends. A missing </parameter> is closed by the next parameter
or the function end. One leading and one trailing wrapping newline are removed from each value.
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers import scan
from helios.output.parsers.base import BaseToolParser, CallError, arguments_from_pairs

OUTER_OPEN, OUTER_CLOSE = "<tool_call>", "</tool_call>"
FUNC_OPEN, FUNC_CLOSE = "<function=", "</function>"
PARAM_OPEN, PARAM_CLOSE = "<parameter=", "</parameter>"


def function_header(buf: str, pos: int) -> tuple[int, str]:
    """<function=NAME> then a <parameter= or </function> tag: (position after the header, NAME) or WAIT/FAIL."""
    pos = scan.literal(buf, pos, FUNC_OPEN)
    end, name = scan.name_until(buf, pos, ">")
    if end < 0:
        return end, ""
    after = end + 1
    check = scan.any_literal(buf, scan.skip_ws(buf, after), (PARAM_OPEN, FUNC_CLOSE))
    return (after, name) if check >= 0 else (check, "")


class QwenXmlToolParser(BaseToolParser):
    name = "qwen_xml"
    ends_reasoning = True
    text_markers = (OUTER_OPEN, FUNC_OPEN)
    block_markers = (FUNC_OPEN, OUTER_CLOSE)
    call_close = FUNC_CLOSE
    junk_ends_block = True  # the outer tags are optional, so answer text may follow a call directly
    strip_wrapping_newlines = True

    def classify(self, buf: str, in_block: bool):
        if buf.startswith(OUTER_CLOSE):
            return ("close", len(OUTER_CLOSE), None) if in_block else ("text", 1, None)
        if buf.startswith(OUTER_OPEN):
            pos, _ = function_header(buf, scan.skip_ws(buf, len(OUTER_OPEN)))
            v = scan.verdict(pos)
            return ("block", len(OUTER_OPEN), None) if v == "ok" else (v, 1, None)
        pos, name = function_header(buf, 0)
        v = scan.verdict(pos)
        return ("call", 0, name) if v == "ok" else (v, 1, None)

    def _value(self, raw: str) -> str:
        if self.strip_wrapping_newlines:
            raw = raw[1:] if raw.startswith("\n") else raw
            raw = raw[:-1] if raw.endswith("\n") else raw
        return raw

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        header_end = envelope.find(">")
        name = envelope[len(FUNC_OPEN):header_end].strip()
        body = envelope[header_end + 1: len(envelope) - len(FUNC_CLOSE)]
        pairs: list[tuple[str, Any]] = []
        pos = body.find(PARAM_OPEN)
        while pos >= 0:
            name_end = body.find(">", pos)
            if name_end < 0:
                raise CallError("unterminated <parameter= tag")
            key = body[pos + len(PARAM_OPEN): name_end].strip()
            start = name_end + 1
            nxt = body.find(PARAM_OPEN, start)
            close = body.find(PARAM_CLOSE, start)
            # NOTE: a missing </parameter> is closed by the next parameter or the end of the function
            end = min(x for x in (close, nxt, len(body)) if x >= 0)
            pairs.append((key, self.tools.convert(name, key, self._value(body[start:end]))))
            pos = nxt
        return name, arguments_from_pairs(pairs)
