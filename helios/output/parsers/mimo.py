"""MiMo compact function tags: Qwen's <function=NAME><parameter=P>value</parameter></function> syntax.

Same recognition rules as qwen_xml (helios.output.parsers.qwen_xml); values are kept verbatim, including
leading/trailing newlines and indentation (spec: "MiMo's compact tags preserve their values verbatim").
"""

from __future__ import annotations

from helios.output.parsers.qwen_xml import QwenXmlToolParser


class MimoToolParser(QwenXmlToolParser):
    name = "mimo"
    strip_wrapping_newlines = False
