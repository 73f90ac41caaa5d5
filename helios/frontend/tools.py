"""The request side of tools for the conversational protocols (Chat Completions, Messages, Responses).

Owns the spec's "Conversation and tool semantics" that every protocol shares once its own spelling is decoded:
the declared tools as typed `FunctionTool`s (the template's HF shape is made only for rendering), tool_choice
(auto / none / required / named), parallel_tool_calls, strict schemas (rejected), a core without a tool parser
(rejected), the tools the template is given (named: only the selected one) and required mode's instruction.
Responses custom tools are presented as a JSON function with one string argument `input` (their grammar,
compiled by helios.frontend.grammar, in the description); a namespaced tool is presented as namespace__name, and
`DeclaredTool` maps a presented name back to what the client declared. `output_spec` turns a plan into the
neutral OutputSpec helios.output parses with. Refusals are InvalidRequest. No torch; must not import the server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from msgspec import Struct

from helios.frontend.chat import ChatMessage
from helios.frontend.grammar import Grammar, compile_grammar
from helios.frontend.reasoning import request_syntax
from helios.frontend.sampling import InvalidRequest
from helios.output.choice import OutputSpec
from helios.output.custom_tools import INPUT
from helios.output.tool_choice import ToolChoiceMode
from helios.output.tool_schema import ToolSchemas, ToolSpec

if TYPE_CHECKING:
    from helios.frontend.context import ModelContext

# NOTE: the one instruction required mode adds; sampling is unchanged and nothing is fabricated or retried
REQUIRED_INSTRUCTION = "You must respond by calling one or more of the provided tools."
NAMESPACE_SEPARATOR = "__"  # a Responses namespace tool is presented as namespace__name

ToolKind = Literal["function", "custom"]


@dataclass(frozen=True)
class DeclaredTool:
    """What the client declared behind one presented name: restored on output items."""

    name: str  # the declared name, without its namespace
    kind: ToolKind = "function"
    namespace: str | None = None
    grammar: Grammar | None = None  # a custom tool's compiled grammar (None: free text, or a function)

    @property
    def presented(self) -> str:
        return f"{self.namespace}{NAMESPACE_SEPARATOR}{self.name}" if self.namespace else self.name


class FunctionTool(Struct, frozen=True, kw_only=True):
    """One declared tool as the model is shown it: a function with a JSON Schema for its arguments."""

    name: str  # the presented name (namespace__name inside a Responses namespace)
    parameters: dict[str, Any]
    description: str | None = None

    def template_shape(self) -> dict[str, Any]:
        """The chat template's (HF) shape: {"type": "function", "function": {name, description, parameters}}."""
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}

    @classmethod
    def from_template(cls, tool: dict[str, Any]) -> FunctionTool:
        fn = tool["function"]
        return cls(name=fn["name"], parameters=fn.get("parameters") or {}, description=fn.get("description"))


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools after validation: what the template sees and what the output must satisfy."""

    tools: list[FunctionTool] = field(default_factory=list)  # every declared tool, in request order
    mode: ToolChoiceMode = "auto"
    named: str | None = None
    parallel: bool = True
    declared: dict[str, DeclaredTool] = field(default_factory=dict)  # by presented name; plain functions absent

    def origin(self, presented: str) -> DeclaredTool:
        """The declaration behind a generated name (an undeclared name reads as a plain function)."""
        return self.declared.get(presented) or DeclaredTool(presented)

    @property
    def custom_grammars(self) -> dict[str, Grammar | None]:
        """Presented name -> grammar of every custom tool the model is shown."""
        shown = {t.name for t in self.shown}
        return {n: d.grammar for n, d in self.declared.items() if d.kind == "custom" and n in shown}

    def schemas(self) -> ToolSchemas:
        """The presented tools as the output parsers see them, each with its namespace."""
        return ToolSchemas(ToolSpec(t.name, t.parameters or {}, self.origin(t.name).namespace) for t in self.shown)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tools]

    @property
    def shown(self) -> list[FunctionTool]:
        """The tools the model is shown: only the selected one under a named choice."""
        if self.mode == "named":
            return [t for t in self.tools if t.name == self.named]
        return self.tools

    @property
    def presented(self) -> list[dict] | None:
        """The shown tools in the template's shape (None without tools)."""
        return [t.template_shape() for t in self.shown] if self.tools else None

    @property
    def parses_tools(self) -> bool:
        return bool(self.tools) and self.mode != "none"


def function_tool(name: Any, description: Any, parameters: Any, strict: Any, param: str) -> FunctionTool:
    """A declared function, checked; strict: true is rejected."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("every tool needs a nonempty name", param)
    if strict is True:
        raise InvalidRequest(f"strict function schemas are not supported (tool {name!r})", param)
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise InvalidRequest(f"the parameters of tool {name!r} must be a JSON Schema object", param)
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"the description of tool {name!r} must be a string", param)
    return FunctionTool(name=name, parameters=parameters, description=description)


def custom_tool(name: Any, description: Any, fmt: Any, param: str, namespace: str | None = None,
                namespace_description: str | None = None) -> tuple[FunctionTool, DeclaredTool]:
    """A Responses custom tool: format {"type": "text"} (or absent) or {"type": "grammar", "syntax": "lark" |
    "regex", "definition"}; the grammar is compiled here, before admission. Presented as a JSON function
    whose one string argument `input` carries the text; the description states the grammar's contract."""
    if not isinstance(name, str) or not name:
        raise InvalidRequest("every tool needs a nonempty name", param)
    if description is not None and not isinstance(description, str):
        raise InvalidRequest(f"the description of tool {name!r} must be a string", param)
    fmt = {"type": "text"} if fmt is None else fmt
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    grammar = None
    if kind == "grammar":
        try:
            grammar = compile_grammar(fmt.get("syntax"), fmt.get("definition"), param)
        except InvalidRequest as e:
            e.message = f"custom tool {name!r}: {e.message}"
            raise
    elif kind != "text":
        raise InvalidRequest(f"custom tool {name!r} has an unsupported format type {kind!r}; use text or grammar",
                             param)
    contract = (f'Call it with one string argument, "{INPUT}", holding the whole text input. '
                + (grammar.contract if grammar is not None else "The input is free-form text."))
    declared = DeclaredTool(name, "custom", namespace, grammar)
    parameters = {"type": "object", "properties": {INPUT: {"type": "string"}}, "required": [INPUT],
                  "additionalProperties": False}
    described = _describe(description, namespace_description, contract)
    return FunctionTool(name=declared.presented, parameters=parameters, description=described), declared


def namespaced(tool: FunctionTool, namespace: str, namespace_description: str | None
               ) -> tuple[FunctionTool, DeclaredTool]:
    """A function tool declared inside a Responses namespace: presented as namespace__name."""
    declared = DeclaredTool(tool.name, "function", namespace)
    described = _describe(tool.description, namespace_description, None)
    return FunctionTool(name=declared.presented, parameters=tool.parameters, description=described), declared


def _describe(description: str | None, namespace_description: str | None, contract: str | None) -> str:
    return "\n\n".join(p for p in (namespace_description, description, contract) if p)


def plan_tools(ctx: ModelContext, tools: list[FunctionTool], mode: ToolChoiceMode = "auto", named: str | None = None,
               parallel: bool = True, param: str = "tools", choice_param: str = "tool_choice",
               declared: list[DeclaredTool] | None = None, named_kind: ToolKind | None = None) -> ToolPlan:
    """Validate the neutral tools and choice against the core; the protocol has decoded its own spelling.

    `declared` (Responses) runs parallel to `tools`: what each presented tool was declared as; `named_kind`
    is the type a named tool_choice asked for, which must match the selected tool's."""
    names = [t.name for t in tools]
    origins = declared or [DeclaredTool(n) for n in names]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        clash = [d for d in origins if d.presented == dup]
        if any(d.namespace for d in clash):
            spelled = " and ".join(f"{d.name!r} in namespace {d.namespace!r}" if d.namespace else f"{d.name!r}"
                                   for d in clash)
            raise InvalidRequest(f"ambiguous tool name {dup!r}: {spelled} both become {dup!r}", param)
        raise InvalidRequest(f"tool names must be unique; {dup!r} is declared twice", param)
    if mode in ("required", "named") and not tools:
        raise InvalidRequest(f"tool_choice {mode} needs at least one declared tool", choice_param)
    if mode == "named" and named not in names:
        raise InvalidRequest(f"tool_choice names {named!r}, which is not declared in tools", choice_param)
    by_name = {d.presented: d for d in origins}
    if mode == "named" and named_kind is not None and by_name[named].kind != named_kind:
        raise InvalidRequest(f"tool_choice selects a {named_kind} tool, but {named!r} is a {by_name[named].kind} "
                             "tool", choice_param)
    if tools and mode != "none" and not ctx.manifest.recipe.tool_parser:
        raise InvalidRequest("this core declares no tool-call parser; tools are not supported", param)
    special = {n: d for n, d in by_name.items() if d.kind != "function" or d.namespace}
    return ToolPlan(tools=list(tools), mode=mode, named=named, parallel=parallel, declared=special)


def with_instruction(messages: list[ChatMessage], plan: ToolPlan | None) -> list[ChatMessage]:
    """Required mode adds its instruction to the leading system message (one is made when none leads)."""
    if plan is None or plan.mode != "required":
        return messages
    if messages and messages[0].role == "system" and messages[0].content:
        first = ChatMessage(role="system", content=messages[0].content + "\n\n" + REQUIRED_INSTRUCTION)
        return [first, *messages[1:]]
    return [ChatMessage(role="system", content=REQUIRED_INSTRUCTION), *messages]


def output_spec(ctx: ModelContext, plan: ToolPlan | None, prompt_ids: list[int] | None = None) -> OutputSpec | None:
    """The parser set of a request: tools when declared (and not "none"), reasoning whenever the recipe
    declares a parser and the prepared template has reasoning syntax (build's rule); None when neither.
    With the prompt's ids, the reasoning parser starts where this request's output starts (the budget's rule)."""
    recipe, syntax = ctx.manifest.recipe, ctx.manifest.template.reasoning
    plan = plan or ToolPlan()
    reasons = recipe.reasoning_parser is not None and (syntax is not None or recipe.reasoning_parser == "dsml")
    if not reasons and not (plan.parses_tools and recipe.tool_parser):
        return None
    if syntax is not None and prompt_ids is not None:
        syntax = request_syntax(syntax, prompt_ids)
    parses = plan.parses_tools
    return OutputSpec(recipe.tool_parser, recipe.reasoning_parser, syntax, tools=plan.schemas() if parses else None,
                      mode=plan.mode if parses else "auto", names=tuple(plan.names), named=plan.named,
                      parallel=plan.parallel, custom_grammars=plan.custom_grammars if parses else {})
