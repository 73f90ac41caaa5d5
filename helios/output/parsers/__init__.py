"""Registry of output parsers by the names recipes declare (ignition/recipes/table.py).

Imports happen inside the factories, so a syntax module loads only when a core declares it. `build` makes
the per-choice OutputParser from a core's Recipe, its TemplateCaps.reasoning and the request's tools.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from helios.core.manifest import ReasoningSyntax
    from helios.output.parsers.base import BaseToolParser
    from helios.output.parsers.pipeline import OutputParser
    from helios.output.parsers.reasoning import DelimiterReasoningParser
    from helios.output.tool_schema import ToolSchemas

# name -> (module, class)
TOOL_PARSERS: dict[str, tuple[str, str]] = {
    "qwen_xml": ("helios.output.parsers.qwen_xml", "QwenXmlToolParser"),
    "mimo": ("helios.output.parsers.mimo", "MimoToolParser"),
    "hermes": ("helios.output.parsers.hermes", "HermesToolParser"),
    "glm": ("helios.output.parsers.glm", "GlmToolParser"),
    "gemma4": ("helios.output.parsers.gemma4", "Gemma4ToolParser"),
    "minimax": ("helios.output.parsers.minimax", "MiniMaxToolParser"),
    "dsml": ("helios.output.parsers.dsml", "DsmlToolParser"),
    "dsml_v4": ("helios.output.parsers.dsml", "DsmlV4ToolParser"),
    "dsml_v41": ("helios.output.parsers.dsml", "DsmlV41ToolParser"),
    "kimi": ("helios.output.parsers.kimi", "KimiToolParser"),
    "step": ("helios.output.parsers.step", "StepToolParser"),
    "xtml": ("helios.output.parsers.xtml", "XtmlToolParser"),
}
_REASONING = "helios.output.parsers.reasoning"
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "think": (_REASONING, "DelimiterReasoningParser"),
    "glm": (_REASONING, "GlmReasoningParser"),
    "minimax": (_REASONING, "MiniMaxReasoningParser"),
    "gemma4": (_REASONING, "Gemma4ReasoningParser"),
    "dsml": (_REASONING, "DsmlReasoningParser"),
    "xtml": ("helios.output.parsers.xtml", "XtmlReasoningParser"),
}


def _load(table: Mapping[str, tuple[str, str]], kind: str, name: str) -> Any:
    if name not in table:
        raise KeyError(f"unknown {kind} parser {name!r} (known: {', '.join(sorted(table))})")
    module, cls = table[name]
    return getattr(importlib.import_module(module), cls)


def make_tool_parser(name: str, tools: ToolSchemas | None = None, **kw: Any) -> BaseToolParser:
    return _load(TOOL_PARSERS, "tool", name)(tools, **kw)


def make_reasoning_parser(name: str, syntax: ReasoningSyntax | None = None,
                          starts_in_reasoning: bool | None = None) -> DelimiterReasoningParser:
    return _load(REASONING_PARSERS, "reasoning", name)(syntax, starts_in_reasoning)


def build(tool_parser: str | None, reasoning_parser: str | None, syntax: ReasoningSyntax | None = None,
          tools: Iterable[Mapping[str, Any]] | ToolSchemas | None = None, *, parse_tools: bool = True,
          new_call_id: Callable[[], str] | None = None) -> OutputParser:
    """One choice's parser. parse_tools=False (no tools, or tool_choice "none") leaves tool syntax as text.

    NOTE: a core without ReasoningSyntax gets no reasoning parser even when its recipe names one (the
    prepared template judges whether the model reasons), except dsml: DeepSeek's native encoder has no
    probed template and its delimiters are text-matched anyway."""
    from helios.output.parsers.pipeline import OutputParser, random_call_id
    from helios.output.tool_schema import ToolSchemas

    schemas = tools if isinstance(tools, ToolSchemas) else ToolSchemas.from_tools(tools)
    use_reasoning = reasoning_parser is not None and (syntax is not None or reasoning_parser == "dsml")
    reasoning = make_reasoning_parser(reasoning_parser, syntax) if use_reasoning else None
    tool = make_tool_parser(tool_parser, schemas) if tool_parser and parse_tools else None
    return OutputParser(reasoning, tool, new_call_id or random_call_id)
