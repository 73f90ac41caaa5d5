"""Reasoning parsers: one streaming state machine over (token_id, text) that splits reasoning from answer.

A delimiter the tokenizer encodes as one token (ReasoningSyntax.open_token_id / close_token_id) switches
only when that token id is generated; the same text written in ordinary pieces stays text. A delimiter
without a token id (Gemma 4's <|channel>thought, DeepSeek's think tags) is matched as text, holding back a
tail that may still complete it. Output starts in reasoning when the generation prompt opened it. Pure Python.
"""

from __future__ import annotations

from typing import Literal

from helios.core.manifest import ReasoningSyntax
from helios.output.parsers.base import partial_tail

Region = Literal["reasoning", "content"]
# (kind, text): text of a region, or a delimiter ("open"/"close") with the text it consumed
Piece = tuple[Literal["reasoning", "content", "open", "close"], str]


class DelimiterReasoningParser:
    """feed(token_id, text) -> pieces in order; end_reasoning() when a tool call ends reasoning implicitly."""

    name = "think"
    default_open, default_close = "<think>", "</think>"
    match_token_ids = True  # False: the syntax's delimiters are always matched as text (DeepSeek)

    def __init__(self, syntax: ReasoningSyntax | None = None, starts_in_reasoning: bool | None = None):
        self.open = syntax.open if syntax else self.default_open
        self.close = syntax.close if syntax else self.default_close
        use_ids = self.match_token_ids and syntax is not None
        self.open_id = syntax.open_token_id if use_ids else None
        self.close_id = syntax.close_token_id if use_ids else None
        if starts_in_reasoning is None:
            starts_in_reasoning = bool(syntax and syntax.starts_in_reasoning)
        self.region: Region = "reasoning" if starts_in_reasoning else "content"
        self._held = ""  # a tail that may still complete a text-matched delimiter

    @property
    def in_reasoning(self) -> bool:
        return self.region == "reasoning"

    def _target(self) -> tuple[str, int | None, Literal["open", "close"]]:
        if self.region == "reasoning":
            return self.close, self.close_id, "close"
        return self.open, self.open_id, "open"

    def _switch(self) -> None:
        self.region = "content" if self.region == "reasoning" else "reasoning"

    def feed(self, token_id: int, text: str) -> list[Piece]:
        delim, delim_id, kind = self._target()
        if delim_id is not None:
            text = self.take_held() + text
            if token_id != delim_id:
                return [(self.region, text)] if text else []
            # NOTE: the delimiter token's own text (present unless specials are skipped) is consumed
            i = text.rfind(delim)
            before, after = (text[:i], text[i + len(delim):]) if i >= 0 else (text, "")
            out: list[Piece] = [(self.region, before)] if before else []
            out.append((kind, delim if i >= 0 else ""))
            self._switch()
            return out + ([(self.region, after)] if after else [])
        return self._feed_text(text)

    def _feed_text(self, text: str) -> list[Piece]:
        buf, self._held = self._held + text, ""
        out: list[Piece] = []
        while buf:
            delim, delim_id, kind = self._target()
            if delim_id is not None:  # the other delimiter is token-matched: the rest is plain text now
                out.append((self.region, buf))
                return out
            i = buf.find(delim)
            if i < 0:
                hold = partial_tail(buf, (delim,))
                if len(buf) > hold:
                    out.append((self.region, buf[: len(buf) - hold]))
                self._held = buf[len(buf) - hold:]
                return out
            if i:
                out.append((self.region, buf[:i]))
            out.append((kind, delim))
            self._switch()
            buf = buf[i + len(delim):]
        return out

    def end_reasoning(self) -> None:
        """A tool call ended reasoning without its close delimiter (Qwen's <tool_call>)."""
        self.region = "content"

    def take_held(self) -> str:
        held, self._held = self._held, ""
        return held

    def finish(self) -> list[Piece]:
        """End of output: a held partial delimiter is text of the current region."""
        held = self.take_held()
        return [(self.region, held)] if held else []


class GlmReasoningParser(DelimiterReasoningParser):
    """GLM: think tags; the output is answer unless the model (or the generation prompt) opened reasoning."""

    name = "glm"


class MiniMaxReasoningParser(DelimiterReasoningParser):
    name = "minimax"
    default_open, default_close = "<mm:think>", "</mm:think>"


class Gemma4ReasoningParser(DelimiterReasoningParser):
    """Gemma 4: <|channel>thought spans tokens (text-matched); <channel|> is one token when the core says so."""

    name = "gemma4"
    default_open, default_close = "<|channel>thought", "<channel|>"


class DsmlReasoningParser(DelimiterReasoningParser):
    """DeepSeek: <think>...</think> always matched as text (spec: as the official parser recognizes them)."""

    name = "dsml"
    match_token_ids = False
