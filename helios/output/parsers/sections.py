"""The section syntaxes (Kimi, Step, MiniMax, DeepSeek DSML): one opener that always starts a block of calls.

Their state machine is one: outside a block the section opener starts it; inside, the section close ends it and
anything else opens a call, which runs to the syntax's call close. A syntax declares its four literals, whether
each call is wrapped in tags of its own around the body (Kimi, Step), and how a body reads: the shared invoke
markup (helios.output.parsers.xml_invoke) or its own `parse_body`. Pure Python.
"""

from __future__ import annotations

from typing import Any, ClassVar

from helios.output.parsers.base import BaseToolParser, Verdict
from helios.output.parsers.xml_invoke import InvokeMarkup


class SectionToolParser(BaseToolParser):
    section_open: ClassVar[str] = ""
    section_close: ClassVar[str] = ""
    call_open: ClassVar[str] = ""  # what opens a call inside the section
    wrapped: ClassVar[bool] = False  # call_open and call_close wrap the body and are not part of it
    markup: ClassVar[InvokeMarkup | None] = None  # how a body reads (None: the syntax overrides parse_body)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.text_markers = (cls.section_open,)
        cls.block_markers = (cls.call_open, cls.section_close)
        if not cls.call_close and cls.markup is not None:
            cls.call_close = cls.markup.invoke_close

    def classify(self, buf: str, in_block: bool) -> tuple[Verdict, int, str | None]:
        if not in_block:
            return "block", len(self.section_open), None
        if buf.startswith(self.section_close):
            return "close", len(self.section_close), None
        return "call", 0, None

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        body = envelope[len(self.call_open): len(envelope) - len(self.call_close)] if self.wrapped else envelope
        return self.parse_body(body)

    def parse_body(self, body: str) -> tuple[str, dict[str, Any]]:
        assert self.markup is not None, f"{type(self).__name__} needs a markup or its own parse_body"
        return self.markup.parse(body, self.tools)
