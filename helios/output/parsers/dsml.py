"""DeepSeek DSML tool calls, our own parser of the syntax (the official state machine is not available).

What we implement: <｜DSML｜function_calls> (always a section) holding <｜DSML｜invoke name="N"> ...
</｜DSML｜invoke> calls, each with <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>
(string="true": text verbatim; "false": a JSON value; absent: schema-guided). Each call is published when its
invoke closes; names and argument names must be nonempty and unique. Closing the section ends parsed
output: later generated text is discarded. ｜ is U+FF5C.
"""

from __future__ import annotations

from helios.output.parsers.sections import SectionToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup

BAR = "\uff5c"
PREFIX = f"{BAR}DSML{BAR}"
OPEN, CLOSE = f"<{PREFIX}function_calls>", f"</{PREFIX}function_calls>"


class DsmlToolParser(SectionToolParser):
    name = "dsml"
    section_open, section_close = OPEN, CLOSE
    call_open = f"<{PREFIX}invoke"
    markup = InvokeMarkup(PREFIX)
    close_ends_output = True
