"""Step tool calls: <|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|><steptml:invoke name="N">
<steptml:parameter name="K">V</steptml:parameter></steptml:invoke><|tool_call_end|>...<|tool_calls_end|>.

The section opener always starts; each <|tool_call_begin|>...<|tool_call_end|> is one call in the shared
invoke markup (helios.output.parsers.xml_invoke), values typed by the declared schema.
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers.base import BaseToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup

OPEN, CLOSE = "<|tool_calls_begin|>", "<|tool_calls_end|>"
CALL_OPEN, CALL_CLOSE = "<|tool_call_begin|>", "<|tool_call_end|>"
_MARKUP = InvokeMarkup("steptml:")


class StepToolParser(BaseToolParser):
    name = "step"
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
        return _MARKUP.parse(envelope[len(CALL_OPEN): len(envelope) - len(CALL_CLOSE)], self.tools)
