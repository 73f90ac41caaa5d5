"""MiniMax calls: <minimax:tool_call><invoke name="N"><parameter name="K">V</parameter></invoke>...</minimax:tool_call>.

The namespace-prefixed opener always starts a section (no start check); each invoke is published when it
closes; values are verbatim text typed by the declared schema (helios.output.parsers.xml_invoke).
"""

from __future__ import annotations

from helios.output.parsers.sections import SectionToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup


class MiniMaxToolParser(SectionToolParser):
    name = "minimax"
    section_open, section_close = "<minimax:tool_call>", "</minimax:tool_call>"
    call_open = "<invoke"
    markup = InvokeMarkup("")
