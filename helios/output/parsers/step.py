"""Step tool calls: <|tool_calls_begin|><|tool_call_begin|>function<|tool_sep|><steptml:invoke name="N">
<steptml:parameter name="K">V</steptml:parameter></steptml:invoke><|tool_call_end|>...<|tool_calls_end|>.

The section opener always starts; each <|tool_call_begin|>...<|tool_call_end|> is one call in the shared
invoke markup (helios.output.parsers.xml_invoke), values typed by the declared schema.
"""

from __future__ import annotations

from helios.output.parsers.sections import SectionToolParser
from helios.output.parsers.xml_invoke import InvokeMarkup


class StepToolParser(SectionToolParser):
    name = "step"
    section_open, section_close = "<|tool_calls_begin|>", "<|tool_calls_end|>"
    call_open, call_close = "<|tool_call_begin|>", "<|tool_call_end|>"
    wrapped = True
    markup = InvokeMarkup("steptml:")
