"""Structured output on every generating route: the protocols' spellings, their rules, the engine's constraint.

Owns the neutral OutputFormat each protocol lowers into (Chat and Completions response_format and the native
structured_outputs extension, Responses text.format, Messages output_format), the spec's combination rules
(no custom stops, ignore_eos or assistant continuation under an output constraint), the JSON-only
instruction added to a conversation's system prompt, and the per-request ConstraintSpec: a grammar validated
over the model's vocabulary, applied after reasoning and beside single-token tool openers.
No torch; must not import the server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from helios.core.native_encoding import native_encoder
from helios.engine.messages import ConstraintSpec
from helios.frontend.chat import ChatMessage
from helios.frontend.grammar import OutputSyntax
from helios.frontend.sampling import InvalidRequest
from helios.frontend.reasoning import output_starts_in_reasoning, tool_open_token_ids
from helios.frontend.tools import ToolPlan

if TYPE_CHECKING:
    from helios.frontend.context import ModelContext

_FORMAT_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a json_schema format's name


@dataclass(frozen=True)
class OutputFormat:
    """One request's output constraint, protocol-neutral: a JSON schema, a Lark or a regex grammar."""

    syntax: OutputSyntax
    definition: Any  # the schema (a dict) or the grammar text
    param: str  # the request field it came from (errors about the format as a whole)
    is_json: bool = False  # JSON output: conversations get the JSON-only instruction
    name: str | None = None
    description: str | None = None
    schema_given: bool = True  # False for json_object: any JSON object, no schema to show
    definition_param: str | None = None  # where the schema or grammar sits when not `param` (compile errors)


def _json_object(param: str) -> OutputFormat:
    return OutputFormat("json_schema", {"type": "object"}, param, is_json=True, schema_given=False)


def _schema(value: Any, param: str) -> dict:
    if isinstance(value, bool):  # JSON Schema's boolean forms: true accepts any JSON value, false none
        if not value:
            raise InvalidRequest("a JSON schema of false accepts no output", param)
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest("the JSON schema must be an object", param)
    return value


def _named_schema(fmt: dict, param: str, top: str) -> OutputFormat:
    """{name, schema, description, strict}: the json_schema format's fields (Chat nests them, Responses not)."""
    name = fmt.get("name")
    if not isinstance(name, str) or not _FORMAT_NAME.match(name):
        raise InvalidRequest("a json_schema format needs a name of 1-64 letters, digits, '_' or '-'", f"{param}.name")
    description = fmt.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest("description must be a string", f"{param}.description")
    strict = fmt.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InvalidRequest("strict must be a boolean", f"{param}.strict")
    schema = _schema(fmt.get("schema", {}), f"{param}.schema")
    return OutputFormat("json_schema", schema, top, is_json=True, name=name, description=description,
                        definition_param=f"{param}.schema")


def _typed_format(value: Any, param: str, nested: bool) -> OutputFormat | None:
    """{"type": "text" | "json_object" | "json_schema", ...}: json_schema's fields nested under "json_schema"
    (Chat, Completions) or beside the type (Responses)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest(f"{param} must be an object", param)
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _json_object(param)
    if kind != "json_schema":
        raise InvalidRequest(f"{param}.type must be text, json_object or json_schema", param)
    if not nested:
        return _named_schema(value, param, param)
    inner = value.get("json_schema")
    if not isinstance(inner, dict):
        raise InvalidRequest(f"{param} json_schema needs a json_schema object", f"{param}.json_schema")
    return _named_schema(inner, f"{param}.json_schema", param)


def chat_response_format(value: Any, param: str = "response_format") -> OutputFormat | None:
    """Chat / Completions response_format: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}."""
    return _typed_format(value, param, nested=True)


def responses_text_format(value: Any, param: str = "text.format") -> OutputFormat | None:
    """Responses text.format: {"type": "text"} | {"type": "json_object"} | {"type": "json_schema", name, schema, ...}."""
    return _typed_format(value, param, nested=False)


def messages_output_format(value: Any, param: str = "output_format") -> OutputFormat | None:
    """Messages output_format (Anthropic structured outputs): {"type": "json_schema", "schema": {...}}."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise InvalidRequest("output_format must be {\"type\": \"json_schema\", \"schema\": {...}}", param)
    return OutputFormat("json_schema", _schema(value.get("schema"), f"{param}.schema"), param, is_json=True,
                        definition_param=f"{param}.schema")


def native_structured_outputs(value: Any, param: str = "structured_outputs") -> OutputFormat | None:
    """The native extension (vLLM's spelling): exactly one of json (a schema), json_object (true), regex,
    grammar (Lark, llguidance dialect) or choice (a list of strings, the output is one of them)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("structured_outputs must be an object", param)
    given = {k: v for k, v in value.items() if v is not None and v is not False}
    unknown = set(given) - {"json", "json_object", "regex", "grammar", "choice"}
    if unknown:
        raise InvalidRequest(f"unsupported structured_outputs field {sorted(unknown)[0]!r}", param)
    if len(given) != 1:
        raise InvalidRequest("structured_outputs takes exactly one of json, json_object, regex, grammar, choice",
                             param)
    [(kind, v)] = given.items()
    if kind == "json":
        try:
            schema = json.loads(v) if isinstance(v, str) else v
        except ValueError:
            raise InvalidRequest("json must be a JSON schema (an object, or a string holding one)",
                                 f"{param}.json") from None
        return OutputFormat("json_schema", _schema(schema, f"{param}.json"), f"{param}.json", is_json=True)
    if kind == "json_object":
        return _json_object(f"{param}.json_object")
    if kind == "choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise InvalidRequest("choice must be a nonempty list of nonempty strings", f"{param}.choice")
        lark = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in v)
        return OutputFormat("lark", lark, f"{param}.choice")
    if not isinstance(v, str) or not v:
        raise InvalidRequest(f"{kind} must be a nonempty string", f"{param}.{kind}")
    return OutputFormat("lark" if kind == "grammar" else "regex", v, f"{param}.{kind}")


def one_format(*formats: OutputFormat | None) -> OutputFormat | None:
    """The request's single output constraint; two spellings at once are refused."""
    given = [f for f in formats if f is not None]
    if len(given) > 1:
        raise InvalidRequest(f"{given[0].param} and {given[1].param} cannot be combined: give one output format",
                             given[1].param)
    return given[0] if given else None


def check_combination(fmt: OutputFormat | None, *, has_stops: bool = False, ignore_eos: bool = False,
                      continuation: bool = False) -> None:
    """The spec's exclusions: custom stops, ignore_eos and assistant continuation take no output constraint."""
    if fmt is None:
        return
    if has_stops:
        raise InvalidRequest(f"{fmt.param} cannot be combined with custom stops", fmt.param)
    if ignore_eos:
        raise InvalidRequest(f"{fmt.param} cannot be combined with ignore_eos: true", fmt.param)
    if continuation:
        raise InvalidRequest(f"{fmt.param} cannot be combined with assistant continuation", fmt.param)


def instruction(fmt: OutputFormat) -> str | None:
    """The JSON-only formatting instruction (with the schema when one is given); None for other grammars."""
    if not fmt.is_json:
        return None
    text = "Respond with a single JSON value only: no prose, no Markdown code fences."
    if fmt.schema_given:
        about = f" ({fmt.description})" if fmt.description else ""
        schema = json.dumps(fmt.definition, ensure_ascii=False, sort_keys=True)
        text += f"\nThe JSON must satisfy this JSON Schema{about}:\n{schema}"
    else:
        text += " The value must be a JSON object."
    return text


def with_format_instruction(messages: list[ChatMessage], fmt: OutputFormat | None) -> list[ChatMessage]:
    """The instruction appended to the leading system message (one is made when none leads)."""
    text = instruction(fmt) if fmt is not None else None
    if text is None:
        return messages
    if messages and messages[0].role == "system" and messages[0].content:
        first = ChatMessage(role="system", content=messages[0].content + "\n\n" + text)
        return [first, *messages[1:]]
    return [ChatMessage(role="system", content=text), *messages]


def compile_format(ctx: ModelContext, fmt: OutputFormat) -> str:
    """The format's serialized llguidance grammar, validated over the model's vocabulary (once per request; the
    engine's constraint owner compiles each child's own state from it, cached by text)."""
    return ctx.output_grammars.compile(fmt.syntax, fmt.definition, fmt.definition_param or fmt.param)


def output_constraint(ctx: ModelContext, grammar: str, prompt_ids: list[int] | None, plan: ToolPlan | None,
                      conversational: bool = True) -> ConstraintSpec:
    """One child's constraint: on a conversation, the grammar starts after reasoning (when this prompt leaves
    output inside it) and a single-token tool opener may take the answer's place."""
    if not conversational:
        return ConstraintSpec(grammar=grammar)
    syntax = ctx.manifest.template.reasoning
    parses_tools = plan is not None and plan.parses_tools
    tool_ids = tool_open_token_ids(ctx, parses_tools)
    if syntax is None or prompt_ids is None or not output_starts_in_reasoning(syntax, prompt_ids):
        return ConstraintSpec(grammar=grammar, tool_open_token_ids=tool_ids)
    if syntax.close_token_id is not None:
        return ConstraintSpec(grammar=grammar, starts_in_reasoning=True, close_token_id=syntax.close_token_id,
                              tool_open_token_ids=tool_ids)
    gate = _answer_gate(ctx, syntax.close)
    if gate is None:  # NOTE: a text close whose ids depend on its neighbours: the grammar applies from the start
        return ConstraintSpec(grammar=grammar, tool_open_token_ids=tool_ids)
    close_ids, release_ids = gate
    return ConstraintSpec(grammar=grammar, starts_in_reasoning=True, close_token_ids=close_ids,
                          tool_open_token_ids=release_ids if parses_tools else tool_ids)


def _answer_gate(ctx: ModelContext, close: str) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """For a reasoning close of several tokens: the ids after which the answer starts (the close, then the answer
    channel's opener of a native encoder that has one: Kimi K3's response channel) and the single-token release
    of that channel (tools follow an empty answer). None unless the text starts and ends with a special token:
    only then do its ids not depend on what the model wrote around it."""
    kind = ctx.manifest.template.kind
    encoder = native_encoder(kind) if kind != "jinja" else None
    text = close + (encoder.answer_open if encoder is not None else "")
    ids = tuple(ctx.tokenizer.encode(text, add_special_tokens=False))
    if not ids or ids[0] not in ctx.tokenizer.special_ids or ids[-1] not in ctx.tokenizer.special_ids:
        return None
    release = encoder.answer_release if encoder is not None else ""
    release_ids = tuple(ctx.tokenizer.encode(release, add_special_tokens=False)) if release else ()
    return ids, release_ids if len(release_ids) == 1 else ()

