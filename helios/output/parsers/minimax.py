"""MiniMax calls: <minimax:tool_call><invoke name="N"><parameter name="K">V</parameter></invoke>...</minimax:tool_call>.

The namespace-prefixed opener always starts a section (no start check); each invoke is published when it
closes; values are verbatim text typed by the declared schema (helios.output.parsers.xml_invoke).
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers.base import BaseToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup

OPEN, CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
_MARKUP = InvokeMarkup("")


class MiniMaxToolParser(BaseToolParser):
    name = "minimax"
    text_markers = (OPEN,)
    block_markers = ("<invoke", CLOSE)
    call_close = _MARKUP.invoke_close

    def classify(self, buf: str, in_block: bool):
        if not in_block:
            return "block", len(OPEN), None
        if buf.startswith(CLOSE):
            return "close", len(CLOSE), None
        return "call", 0, None

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        return _MARKUP.parse(envelope, self.tools)
