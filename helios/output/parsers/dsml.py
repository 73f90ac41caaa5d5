"""DeepSeek DSML tool calls in their three spellings, our own parser of the syntax (the official state machine is
not available).

One shape, three tag spellings; each core parses exactly the one its prompt format teaches (ignition records it):
- `dsml` (V3.2, Jinja cores): <｜DSML｜function_calls> holding <｜DSML｜invoke name="N"> ... </｜DSML｜invoke> calls,
  each with <｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>.
- `dsml_v4` (template kind deepseek_v4): the same invoke/parameter tags inside <｜DSML｜tool_calls>.
- `dsml_v41` (template kind deepseek_v41): the spaced tags <｜DSML｜ calls>, <｜DSML｜ invoke name="N">,
  <｜DSML｜ parameter name="K" string="...">, closed by </｜DSML｜ parameter>, </｜DSML｜ invoke>, </｜DSML｜ calls>.
The V4 / V4.1 spellings are the ones helios/core/deepseek_encoding.py renders (DeepSeek's encoding scripts). A
spelling's parser treats the other spellings as text: the native encoders teach one spelling only, so another
one in the output is prose (a model quoting a format), not a call.

In every spelling the opener always starts a section; string="true": text verbatim; "false": a JSON value;
absent: schema-guided. Each call is published when its invoke closes; names and argument names must be nonempty
and unique. Closing the section ends parsed output: later generated text is discarded. ｜ is U+FF5C.
"""

from __future__ import annotations

from typing import Any

from helios.output.parsers.sections import SectionToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup

BAR = "\uff5c"
PREFIX = f"{BAR}DSML{BAR}"  # V3.2 and V4 tag prefix
PREFIX_V41 = f"{PREFIX} "  # V4.1: a space before every tag name


class DsmlSpelling(SectionToolParser):
    """A DSML spelling from its tag prefix and calls-section name (class keywords `prefix`, `calls`)."""

    close_ends_output = True

    def __init_subclass__(cls, prefix: str = PREFIX, calls: str = "", **kwargs: Any) -> None:
        cls.section_open, cls.section_close = f"<{prefix}{calls}>", f"</{prefix}{calls}>"
        cls.call_open = f"<{prefix}invoke"
        cls.markup = InvokeMarkup(prefix)
        cls.call_close = cls.markup.invoke_close
        super().__init_subclass__(**kwargs)


class DsmlToolParser(DsmlSpelling, calls="function_calls"):
    """DeepSeek V3.2 (Jinja template cores)."""

    name = "dsml"


class DsmlV4ToolParser(DsmlSpelling, calls="tool_calls"):
    """DeepSeek V4 (the deepseek_v4 native encoder): V3.2's invoke/parameter tags in a tool_calls section."""

    name = "dsml_v4"


class DsmlV41ToolParser(DsmlSpelling, prefix=PREFIX_V41, calls="calls"):
    """DeepSeek V4.1 (the deepseek_v41 native encoder): the spaced ` calls` / ` invoke` / ` parameter` tags."""

    name = "dsml_v41"
