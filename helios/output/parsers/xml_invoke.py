"""The invoke/parameter markup shared by MiniMax, DeepSeek DSML and Step: one call body -> (name, args).

<{p}invoke name="NAME"><{p}parameter name="K" [string="true|false"]>V</{p}parameter>...</{p}invoke>, with
{p} the syntax's tag prefix. Values are verbatim; string="true" keeps text, string="false" reads JSON, no
attribute means schema-guided conversion. A missing parameter close is closed by the next parameter or
the invoke end.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from helios.output.parsers.base import CallError, arguments_from_pairs
from helios.output.tool_schema import ToolSchemas


class InvokeMarkup:
    def __init__(self, prefix: str):
        p = re.escape(prefix)
        self.invoke = re.compile(rf'<{p}invoke\s+name="([^"]*)"\s*>')
        self.param = re.compile(rf'<{p}parameter\s+name="([^"]*)"(?:\s+string="(true|false)")?\s*>')
        self.param_close = f"</{prefix}parameter>"
        self.invoke_close = f"</{prefix}invoke>"

    def parse(self, text: str, tools: ToolSchemas) -> tuple[str, dict[str, Any]]:
        head = self.invoke.search(text)
        if head is None:
            raise CallError('expected <invoke name="...">')
        name = head.group(1).strip()
        end_all = text.find(self.invoke_close, head.end())
        body = text[head.end(): end_all if end_all >= 0 else len(text)]
        pairs: list[tuple[str, Any]] = []
        matches = list(self.param.finditer(body))
        for k, m in enumerate(matches):
            stop = matches[k + 1].start() if k + 1 < len(matches) else len(body)
            close = body.find(self.param_close, m.end(), stop)
            raw = body[m.end(): close if close >= 0 else stop]
            pairs.append((m.group(1).strip(), self._value(tools, name, m.group(1).strip(), raw, m.group(2))))
        return name, arguments_from_pairs(pairs)

    @staticmethod
    def _value(tools: ToolSchemas, tool: str, key: str, raw: str, string_attr: str | None) -> Any:
        if string_attr == "true":
            return raw
        if string_attr == "false":
            try:
                return msgspec.json.decode(raw.strip())
            except msgspec.DecodeError:
                pass  # NOTE: non-strict: fall back to the schema, then the text itself
        return tools.convert(tool, key, raw)
