"""Declared tools as the output side sees them, and schema-guided conversion of parameter values.

Owns ToolSpec/ToolSchemas (name -> parameters schema, namespace) and `convert_value`: best-effort typing of a
text-valued parameter (Qwen/GLM/MiniMax/DSML tags) from its declared JSON Schema. Strings stay untouched; a
value that does not convert is kept as its text (non-strict schemas never reject). Pure Python + msgspec.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable, Mapping
from typing import Any

import msgspec
from msgspec import Struct

_INT = re.compile(r"-?\d+")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_NOTHING = object()


class ToolSpec(Struct, frozen=True):
    name: str  # the name presented to the model (namespace__name for a namespaced Responses tool)
    parameters: dict = {}  # the declared JSON Schema of the arguments object
    namespace: str | None = None


class ToolSchemas:
    """Declared tools by presented name; `lookup` is None for an undeclared tool (no conversion then)."""

    def __init__(self, specs: Iterable[ToolSpec] = ()):
        self.specs = {s.name: s for s in specs}

    @classmethod
    def from_tools(cls, tools: Iterable[Mapping[str, Any]] | None) -> ToolSchemas:
        """From the frontend's tool dicts: {"type": "function", "function": {...}} or a flat {name, parameters}."""
        specs = []
        for tool in tools or ():
            fn = tool.get("function", tool)
            if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
                params = fn.get("parameters")
                specs.append(ToolSpec(fn["name"], params if isinstance(params, dict) else {}, fn.get("namespace")))
        return cls(specs)

    def lookup(self, name: str) -> ToolSpec | None:
        return self.specs.get(name)

    def property_schema(self, tool: str, param: str) -> dict | None:
        spec = self.specs.get(tool)
        if spec is None:
            return None
        props = spec.parameters.get("properties")
        prop = props.get(param) if isinstance(props, dict) else None
        return prop if isinstance(prop, dict) else None

    def convert(self, tool: str, param: str, raw: str) -> Any:
        return convert_value(raw, self.property_schema(tool, param))


def schema_types(schema: Mapping[str, Any] | None) -> list[str]:
    """Declared JSON types in order: `type` (a name or a list), else those of anyOf/oneOf branches."""
    if not schema:
        return []
    declared = schema.get("type")
    if isinstance(declared, str):
        return [declared]
    if isinstance(declared, list):
        return [t for t in declared if isinstance(t, str)]
    out: list[str] = []
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, Mapping):
                out += [t for t in schema_types(branch) if t not in out]
    return out


def convert_value(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """Text of one parameter -> a JSON value guided by its schema; no schema or "string" keeps the text."""
    types = schema_types(schema)
    if not types or "string" in types:
        return raw
    for t in types:
        value = _convert_one(raw.strip(), t)
        if value is not _NOTHING:
            return value
    return raw  # NOTE: non-strict: an invalid value is kept as generated, never rejected


def _convert_one(text: str, json_type: str) -> Any:
    if json_type == "integer":
        return int(text) if _INT.fullmatch(text) else _NOTHING
    if json_type == "number":
        if not _NUMBER.fullmatch(text):
            return _NOTHING
        try:
            return msgspec.json.decode(text)
        except msgspec.DecodeError:  # out of float range (1e400): keep the text
            return _NOTHING
    if json_type == "boolean":
        low = text.lower()
        return True if low == "true" else False if low == "false" else _NOTHING
    if json_type == "null":
        return None if text in ("null", "None") else _NOTHING
    if json_type in ("object", "array"):
        want = dict if json_type == "object" else list
        try:
            value = msgspec.json.decode(text)
        except msgspec.DecodeError:
            value = _literal(text)  # Python-style {'a': 1} is common in model output
        return value if isinstance(value, want) else _NOTHING
    return _NOTHING


def _literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
        msgspec.json.encode(value)  # only values JSON can carry (no complex numbers, ...)
        return value
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return _NOTHING
