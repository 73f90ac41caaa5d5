"""The streaming state machine every text-matched tool-call syntax shares; syntaxes supply hooks.

Owns: scanning text for markers (holding back a tail that may still become one), blocks (an outer section
such as <minimax:tool_call>), buffering each call envelope until it closes, the 8 MiB argument bound, the
finish rules (a truncated envelope is omitted; a recognized call or undecided tag at natural completion is an
error) and the checks shared by all syntaxes (nonempty name, nonempty unique argument names, a JSON object).
Decisions depend only on the text seen so far, never on how it was split into deltas. Pure Python.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

import msgspec
from msgspec import Struct

from helios.output.events import MAX_ARGUMENT_BYTES, ParseError
from helios.output.tool_schema import ToolSchemas

Verdict = Literal["wait", "text", "block", "close", "call"]


class CallError(Exception):
    """A malformed envelope: becomes ParseError(invalid_call)."""


class CallStarted(Struct, frozen=True):
    name: str | None = None


class ParsedCall(Struct, frozen=True):
    name: str
    arguments: str  # compact JSON object text


Item = str | CallStarted | ParsedCall | ParseError  # str: text outside any envelope, in order


def earliest(buf: str, markers: tuple[str, ...], start: int = 0) -> int:
    """Index of the first full occurrence of any marker at or after `start`, or -1."""
    best = -1
    for m in markers:
        i = buf.find(m, start)
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def partial_tail(buf: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of some marker (0 if none)."""
    longest = max((len(m) for m in markers), default=1) - 1
    for k in range(min(len(buf), longest), 0, -1):
        tail = buf[-k:]
        if any(m.startswith(tail) and len(m) > k for m in markers):
            return k
    return 0


def hold_partial(buf: str, markers: tuple[str, ...]) -> tuple[str, str]:
    """`buf` holding no whole marker -> (the text to pass on now, the tail held back: it may still become one)."""
    cut = len(buf) - partial_tail(buf, markers)
    return buf[:cut], buf[cut:]


def arguments_from_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """Named argument values -> the arguments object; names must be nonempty and unique."""
    args: dict[str, Any] = {}
    for key, value in pairs:
        if not key:
            raise CallError("empty argument name")
        if key in args:
            raise CallError(f"duplicate argument {key!r}")
        args[key] = value
    return args


class BaseToolParser:
    """feed(text) -> items in order; finish(truncated) at the end; interrupt() at a reasoning boundary."""

    name: ClassVar[str] = ""
    ends_reasoning: ClassVar[bool] = False  # calls are recognized inside reasoning and end it (Qwen)
    text_markers: ClassVar[tuple[str, ...]] = ()  # what may open a block or a call in ordinary text
    block_markers: ClassVar[tuple[str, ...]] = ()  # call openers and the block close, inside a block
    call_close: ClassVar[str] = ""  # the literal that ends a call envelope
    junk_ends_block: ClassVar[bool] = False  # other text inside a block closes it (optional outer tags)
    close_ends_output: ClassVar[bool] = False  # closing the block ends parsed output (DSML)

    def __init__(self, tools: ToolSchemas | None = None, max_argument_bytes: int = MAX_ARGUMENT_BYTES):
        self.tools = tools or ToolSchemas()
        self.max_argument_bytes = max_argument_bytes
        self._buf = ""
        self._state: Literal["text", "block", "call", "done"] = "text"
        self._call_in_block = False
        self._call_parts: list[str] = []  # the open envelope so far
        self._call_len = 0
        self._call_tail = ""  # its last len(call_close) - 1 chars: where a close may straddle two pieces

    # -- hooks -------------------------------------------------------------------------------------------
    def classify(self, buf: str, in_block: bool) -> tuple[Verdict, int, str | None]:
        """`buf` starts with a marker: (verdict, chars consumed for text/block/close, call name if known)."""
        raise NotImplementedError

    def parse_call(self, envelope: str) -> tuple[str, dict[str, Any]]:
        """A closed envelope -> (name, arguments); raise CallError when malformed."""
        raise NotImplementedError

    # -- streaming ---------------------------------------------------------------------------------------
    @property
    def in_call(self) -> bool:
        return self._state == "call"

    @property
    def is_done(self) -> bool:
        return self._state == "done"

    @property
    def is_undecided(self) -> bool:
        """A tag that may still start a call is held (the thinking budget must not cut in then)."""
        if self._state == "text":
            return earliest(self._buf, self.text_markers) == 0
        return self._state == "block" and earliest(self._buf.lstrip(), self.block_markers) == 0

    def feed(self, text: str) -> tuple[list[Item], str]:
        """Scan `text` -> (items, rest). It stops right after a call closes: `rest` is the text after it,
        unread, so the caller can look at it again under the state the call left (it may end reasoning)."""
        out: list[Item] = []
        if self._state == "done" or not text:
            return out, ""
        self._buf += text
        while True:
            was_call = self._state == "call"
            moved = self._step(out)
            if was_call and self._state in ("text", "block"):
                rest, self._buf = self._buf, ""
                return out, rest
            if not moved:
                return out, ""

    def _step(self, out: list[Item]) -> bool:
        """One decision; True when the machine moved and should look again."""
        if self._state == "text":
            return self._scan_text(out)
        if self._state == "block":
            return self._scan_block(out)
        if self._state == "call":
            return self._scan_call(out)
        self._buf = ""  # done: later text is discarded
        return False

    def _scan_text(self, out: list[Item]) -> bool:
        buf = self._buf
        pos = earliest(buf, self.text_markers)
        if pos < 0:
            ready, self._buf = hold_partial(buf, self.text_markers)
            if ready:
                out.append(ready)
            return False
        if pos:
            out.append(buf[:pos])
            buf = self._buf = buf[pos:]
        verdict, n, name = self.classify(buf, False)
        if verdict == "wait":
            return False
        if verdict == "block":
            self._buf, self._state = buf[n:], "block"
        elif verdict == "call":
            self._start_call(out, name, in_block=False)
        else:  # not a tag after all (a quoted tag in prose): its first char is text, look again after it
            n = max(n, 1)
            out.append(buf[:n])
            self._buf = buf[n:]
        return True

    def _scan_block(self, out: list[Item]) -> bool:
        buf = self._buf
        rest = buf.lstrip()
        if not rest:
            return False
        pos = earliest(rest, self.block_markers)
        if pos != 0:
            if pos < 0 and partial_tail(rest, self.block_markers) == len(rest):
                return False  # a marker may still be forming
            if self.junk_ends_block:
                self._state = "text"  # NOTE: the whitespace before the text stays text
                return True
            if pos < 0:  # discard text inside the block, keep what may begin a marker
                _, self._buf = hold_partial(rest, self.block_markers)
                return False
            self._buf = rest[pos:]
            return True
        verdict, n, name = self.classify(rest, True)
        if verdict == "wait":
            return False
        if verdict == "close":
            self._buf, self._state = rest[n:], ("done" if self.close_ends_output else "text")
        elif verdict == "call":
            self._buf = rest
            self._start_call(out, name, in_block=True)
        elif self.junk_ends_block:
            self._state = "text"
        else:
            self._buf = rest[max(n, 1):]
        return True

    def _start_call(self, out: list[Item], name: str | None, in_block: bool) -> None:
        self._state, self._call_in_block = "call", in_block
        self._call_parts, self._call_len, self._call_tail = [], 0, ""
        out.append(CallStarted(name))

    def _scan_call(self, out: list[Item]) -> bool:
        # NOTE: the envelope grows as a list of pieces and only the seam is searched for the close, so a long
        # call (a file written through a tool) costs linear time, not a copy of the envelope per token
        text, self._buf = self._buf, ""
        close = self.call_close
        window = self._call_tail + text
        i = window.find(close)
        if i < 0:
            self._call_parts.append(text)
            self._call_len += len(text)
            self._call_tail = window[max(0, len(window) - len(close) + 1):] if len(close) > 1 else ""
            # chars <= UTF-8 bytes, so an envelope longer than the bound in chars can never fit it
            if self._call_len > self.max_argument_bytes + 65536:
                self._fail(out, ParseError("too_large", f"tool arguments exceed {self.max_argument_bytes} bytes"))
            return False
        cut = i + len(close) - len(self._call_tail)  # where the envelope ends in `text`
        self._call_parts.append(text[:cut])
        envelope, self._buf = "".join(self._call_parts), text[cut:]
        self._call_parts = []
        self._state = "block" if self._call_in_block else "text"
        item = self._finalize(envelope)
        if isinstance(item, ParseError):
            self._fail(out, item)
            return False
        out.append(item)
        return True

    def _finalize(self, envelope: str) -> ParsedCall | ParseError:
        try:
            name, args = self.parse_call(envelope)
        except CallError as e:
            return ParseError("invalid_call", f"{self.name} tool call: {e}")
        if not name:
            return ParseError("invalid_call", f"{self.name} tool call: empty tool name")
        if not isinstance(args, dict):
            return ParseError("invalid_call", f"{self.name} tool call {name!r}: arguments are not a JSON object")
        try:
            encoded = msgspec.json.encode(args)
        except (TypeError, ValueError, OverflowError) as e:
            return ParseError("invalid_call", f"{self.name} tool call {name!r}: {e}")
        if len(encoded) > self.max_argument_bytes:
            return ParseError("too_large", f"tool call {name!r}: arguments exceed {self.max_argument_bytes} bytes")
        return ParsedCall(name, encoded.decode())

    def _fail(self, out: list[Item], error: ParseError) -> None:
        out.append(error)
        self._state, self._buf = "done", ""

    def interrupt(self) -> list[Item]:
        """A reasoning boundary outside any call: what is held (a partial or undecided tag) is plain text."""
        if self._state in ("call", "done"):
            return []
        held, self._buf, self._state = self._buf, "", "text"
        return [held] if held else []

    def finish(self, truncated: bool) -> list[Item]:
        """End of output. truncated: the output limit cut it (an open envelope is omitted, not an error)."""
        state, buf = self._state, self._buf
        self._buf = ""
        self._state = "done"
        if state == "done":
            return []
        pending = state == "call" or earliest(buf.lstrip() if state == "block" else buf,
                                              self.block_markers if state == "block" else self.text_markers) == 0
        if pending:  # a recognized call, or a tag still undecided
            if truncated:
                return []
            return [ParseError("incomplete_call", f"{self.name} tool call incomplete at the end of the output")]
        if state == "block":  # whitespace inside a block is layout; a partial marker is text if text may follow
            return [buf] if self.junk_ends_block and buf.strip() else []
        return [buf] if buf else []
