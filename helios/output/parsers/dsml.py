"""DeepSeek DSML tool calls, our own parser of the syntax (the official state machine is not available).

What we implement: <｜DSML｜function_calls> (always a section) holding <｜DSML｜invoke name="N"> ...
</｜DSML｜invoke> calls, each with <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
(string="true": text verbatim; "false": a JSON value; absent: schema-guided). Each call is published when its
invoke closes; names and argument names must be nonempty and unique. Closing the section ends parsed
output: later generated text is discarded. ｜ is U+FF5C.
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers.base import BaseToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup

BAR = "\uff5c"
PREFIX = f"{BAR}DSML{BAR}"
OPEN, CLOSE = f"<{PREFIX}function_calls>", f"</{PREFIX}function_calls>"
_MARKUP = InvokeMarkup(PREFIX)


class DsmlToolParser(BaseToolParser):
    name = "dsml"
    text_markers = (OPEN,)
    block_markers = (f"<{PREFIX}invoke", CLOSE)
    call_close = _MARKUP.invoke_close
    close_ends_output = True

    def classify(self, buf: str, in_block: bool):
        if not in_block:
            return "block", len(OPEN), None
        if buf.startswith(CLOSE):
            return "close", len(CLOSE), None
        return "call", 0, None

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        return _MARKUP.parse(envelope, self.tools)
