"""Schema-guided, best-effort conversion of text parameter values."""

from __future__ import annotations

from helios.output.tool_schema import ToolSchemas, ToolSpec, convert_value


def test_types_from_schema():
    assert convert_value(" 42 ", {"type": "integer"}) == 42
    assert convert_value("4.5", {"type": "number"}) == 4.5 and convert_value("-3", {"type": "number"}) == -3
    assert convert_value("TRUE", {"type": "boolean"}) is True and convert_value("false", {"type": "boolean"}) is False
    assert convert_value('{"a": [1]}', {"type": "object"}) == {"a": [1]}
    assert convert_value("{'a': 1}", {"type": "object"}) == {"a": 1}  # Python-style dicts are common
    assert convert_value("[1, 2]", {"type": "array"}) == [1, 2]
    assert convert_value("null", {"type": ["integer", "null"]}) is None
    assert convert_value("7", {"anyOf": [{"type": "integer"}, {"type": "null"}]}) == 7


def test_strings_untouched_and_invalid_values_kept():
    assert convert_value(" 42\n", {"type": "string"}) == " 42\n"
    assert convert_value("42", {"type": ["string", "integer"]}) == "42"
    assert convert_value("4.5", {"type": "integer"}) == "4.5"
    assert convert_value("yes", {"type": "boolean"}) == "yes"
    assert convert_value("[1, 2", {"type": "array"}) == "[1, 2"
    assert convert_value("{1j: 2}", {"type": "object"}) == "{1j: 2}"
    assert convert_value("7", None) == "7" and convert_value("7", {}) == "7"
    assert convert_value("1e400", {"type": "number"}) == "1e400"  # out of float range


def test_tool_schemas_from_frontend_tools():
    schemas = ToolSchemas.from_tools([
        {"type": "function", "function": {"name": "f", "parameters": {"properties": {"n": {"type": "integer"}}}}},
        {"name": "g"},
    ])
    assert schemas.convert("f", "n", "3") == 3 and schemas.convert("f", "m", "3") == "3"
    assert schemas.convert("g", "n", "3") == "3" and schemas.convert("unknown", "n", "3") == "3"
    ns = ToolSchemas([ToolSpec("files__read", {}, "files")])
    assert ns.lookup("files__read").namespace == "files"
