"""Gemma 4 tool calls: <|tool_call>call:NAME{key:value,...}<tool_call|>; the opener always starts a call.

The concrete format we implement: the body is `call:` NAME and one object. Values: <|"|>text<|"|> is a
string (verbatim); {k:v,...} an object (keys bare or quoted); [v,...] an array; a bare token is true,
false, null or a number when it reads as one, else kept as its text. No schema conversion: the syntax
carries its own types.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from helios.output.parsers.base import BaseToolParser, CallError

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


class _Reader:
    def __init__(self, text: str):
        self.text, self.pos = text, 0

    def ws(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def peek(self, s: str) -> bool:
        self.ws()
        return self.text.startswith(s, self.pos)

    def expect(self, s: str) -> None:
        if not self.peek(s):
            raise CallError(f"expected {s!r} at offset {self.pos}")
        self.pos += len(s)

    def string(self) -> str:
        self.expect(QUOTE)
        end = self.text.find(QUOTE, self.pos)
        if end < 0:
            raise CallError("unterminated string")
        value, self.pos = self.text[self.pos:end], end + len(QUOTE)
        return value

    def value(self, depth: int = 0) -> Any:
        if depth > 64:
            raise CallError("nesting too deep")
        if self.peek(QUOTE):
            return self.string()
        if self.peek("{"):
            return self.obj(depth)
        if self.peek("["):
            self.expect("[")
            items: list[Any] = []
            while not self.peek("]"):
                if items:
                    self.expect(",")
                items.append(self.value(depth + 1))
            self.expect("]")
            return items
        return self.bare()

    def bare(self) -> Any:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] not in ",}]":
            self.pos += 1
        token = self.text[start:self.pos].strip()
        if not token:
            raise CallError(f"missing value at offset {start}")
        if token in ("true", "false", "null"):
            return {"true": True, "false": False, "null": None}[token]
        if _NUMBER.fullmatch(token):
            try:
                return msgspec.json.decode(token)
            except msgspec.DecodeError:  # out of float range: keep the text
                return token
        return token

    def obj(self, depth: int) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        while not self.peek("}"):
            if out:
                self.expect(",")
            if self.peek(QUOTE):
                key = self.string()
            else:
                colon = self.text.find(":", self.pos)
                if colon < 0:
                    raise CallError("expected key:value")
                key, self.pos = self.text[self.pos:colon].strip(), colon
            self.expect(":")
            if not key or key in out:
                raise CallError(f"empty or duplicate argument name {key!r}")
            out[key] = self.value(depth + 1)
        self.expect("}")
        return out


class Gemma4ToolParser(BaseToolParser):
    name = "gemma4"
    text_markers = (OPEN,)
    call_close = CLOSE

    def classify(self, buf: str, in_block: bool):
        return "call", 0, None

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        body = envelope[len(OPEN): len(envelope) - len(CLOSE)].strip()
        if not body.startswith("call:") or "{" not in body:
            raise CallError("expected call:NAME{...}")
        brace = body.index("{")
        reader = _Reader(body[brace:])
        args = reader.obj(0)
        reader.ws()
        if reader.pos != len(reader.text):
            raise CallError("text after the arguments object")
        return body[len("call:"):brace].strip(), args
