"""Per-choice output pipeline: EngineOutput -> neutral deltas (text, logprob entries, finish cause).

Order per token: token-sequence holdback -> incremental detokenizer -> string stop matcher. A terminating
EOS or token stop is hidden from text and logprobs; a token partly clipped by a string stop keeps its entry
and full bytes, tokens entirely beyond it have none (spec: "Generation log probabilities"). Each delta also
carries the released tokens as (token_id, text) pairs for the reasoning/tool parsers, specials included.
Protocol encoders turn the deltas into their JSON. No torch, no server imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct

from helios.engine.messages import EngineOutput, PositionLogprobs, SamplingParams, TokenLogprob
from helios.output.detokenizer import IncrementalDetokenizer
from helios.output.stop import StopMatcher, TokenSequenceHoldback

NON_FINITE_LOGPROB = -9999.0
NO_TOKEN = -1  # the token id of parser text that no single token produced (UTF-8 bytes flushed at the end)


def finite(value: float) -> float:
    return value if math.isfinite(value) else NON_FINITE_LOGPROB


class TokenEntry(Struct, frozen=True):
    """One generated position's logprob record, ready for a protocol encoder."""

    token_id: int
    token_bytes: bytes
    logprob: float
    top: list[TokenLogprob]  # natural alternatives, or explicit ids with the chosen appended when absent
    text_offset: int  # chars of completion text before this token's first char


class OutputDelta(Struct):
    text: str = ""
    entries: list[TokenEntry] = []
    # (token_id, text) per released token for the output parsers: special tokens keep their text even when
    # `text` hides them; a terminating EOS/stop token has none; text beyond a matched stop string is cut
    tokens: list[tuple[int, str]] = []
    num_new_tokens: int = 0  # native tokens generated in this step (including hidden stop tokens)
    token_ids: list[int] = []  # those tokens' ids, in order (return_token_ids)
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: str | int | list[int] | None = None  # matched stop string or token(s)
    error: str | None = None
    prompt_logprobs: list[PositionLogprobs] | None = None


class OutputProcessor:
    """Feed one choice's EngineOutputs in order; each call returns what may be shown now."""

    def __init__(
        self,
        token_bytes: Sequence[bytes],
        special_ids: frozenset[int],
        sampling: SamplingParams,
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        control_ids: frozenset[int] = frozenset(),
    ):
        self._detok = IncrementalDetokenizer(token_bytes, special_ids, skip_special_tokens)
        self._stops = StopMatcher(stops)
        self._holdback = TokenSequenceHoldback(sampling.stop_token_sequences)
        self._want_logprobs = sampling.logprobs is not None
        self._num_top = sampling.logprobs or 0
        self._explicit = sampling.logprob_token_ids is not None
        self._held: list[tuple[int, PositionLogprobs | None]] = []  # tokens withheld for sequence stops
        self._all_ids: list[int] = []
        self._entries: list[TokenEntry] = []  # entries withheld until their text clears the stop matcher
        # NOTE: [token_id, parser text, visible chars not yet released by the stop matcher] per token
        self._pairs: list[list] = []
        self._skip_special = skip_special_tokens
        self._special = special_ids
        # NOTE: EOS and control tokens (BOS, PAD) give the parsers no text; other specials keep theirs
        self._no_parser_text = frozenset(sampling.eos_token_ids) | control_ids
        self.num_generated = 0
        self.num_prompt_tokens = 0
        self.num_cached_tokens = 0
        self.text = ""  # all text released so far
        self.finished = False
        self.finish_reason: str | None = None

    def _entry(self, token_id: int, record: PositionLogprobs | None, offset: int) -> TokenEntry | None:
        if not self._want_logprobs or record is None:
            return None
        top = list(record.alternatives) if self._explicit else list(record.alternatives[: self._num_top])
        if self._explicit and all(t.token_id != token_id for t in top):
            top.append(record.token)
        return TokenEntry(token_id, self._detok.token_bytes(token_id), finite(record.token.logprob), top, offset)

    def _release_entries(self, limit: int | None) -> list[TokenEntry]:
        """Entries whose first char precedes `limit` (None: all)."""
        if limit is None:
            out, self._entries = self._entries, []
            return out
        out = [e for e in self._entries if e.text_offset < limit]
        self._entries = [e for e in self._entries if e.text_offset >= limit]
        return out

    def _pair_text(self, token_id: int, piece: str) -> str:
        """The parser's text of one token: specials hidden from `text` keep theirs (EOS/control ids excepted)."""
        if self._skip_special and token_id in self._special:
            if token_id in self._no_parser_text:
                return ""
            return self._detok.token_bytes(token_id).decode("utf-8", errors="replace")
        return piece

    def _release(self, num_chars: int, delta: OutputDelta) -> None:
        """The stop matcher released num_chars more visible chars: tokens whose text is all out go to the parsers."""
        while self._pairs:
            pair = self._pairs[0]
            take = min(pair[2], num_chars)
            pair[2] -= take
            num_chars -= take
            if pair[2]:
                return  # partly released: the token waits for the rest of its text
            delta.tokens.append((pair[0], pair[1]))
            self._pairs.pop(0)

    def _cut(self, num_chars: int, delta: OutputDelta) -> None:
        """A stop string matched after num_chars more released chars: the token it begins in keeps its text
        before the stop; tokens after it are dropped."""
        self._release(num_chars, delta)
        if self._pairs:
            token_id, text, pending = self._pairs[0]
            if len(text) > pending:
                delta.tokens.append((token_id, text[: len(text) - pending]))
        self._pairs = []

    def _emit(self, token_id: int, record: PositionLogprobs | None, delta: OutputDelta) -> None:
        offset = self._detok.num_chars
        piece = self._detok.push(token_id)
        entry = self._entry(token_id, record, offset)
        if entry is not None:
            self._entries.append(entry)
        self._pairs.append([token_id, self._pair_text(token_id, piece), len(piece)])
        released, matched = self._feed_stops(piece, delta)
        if not matched:
            self._release(len(released), delta)
            delta.entries += self._release_entries(self._stops.num_released if self._stops.stops else None)

    def _feed_stops(self, piece: str, delta: OutputDelta) -> tuple[str, bool]:
        """Text through the stop matcher: (released text, whether a stop string ended the choice here)."""
        released, matched = self._stops.feed(piece)
        delta.text += released
        if matched is None:
            return released, False
        self._finish(delta, "stop", matched)
        self._cut(len(released), delta)
        delta.entries += self._release_entries(self._stops.match_pos)
        self._entries = []
        return released, True

    def _finish(self, delta: OutputDelta, reason: str, stop_reason=None) -> None:
        self.finished = True
        self.finish_reason = reason
        delta.finished = True
        delta.finish_reason = reason
        delta.stop_reason = stop_reason

    def process(self, out: EngineOutput) -> OutputDelta:
        delta = self._process(out)
        self.text += delta.text
        return delta

    def _process(self, out: EngineOutput) -> OutputDelta:
        delta = OutputDelta(num_new_tokens=len(out.new_token_ids), token_ids=list(out.new_token_ids),
                            prompt_logprobs=out.prompt_logprobs)
        self.num_generated += len(out.new_token_ids)
        if out.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
        if self.finished:
            return delta
        # NOTE: a forced token (the reasoning close at the thinking budget) was not sampled: it counts in
        # num_generated and reaches the parsers, but has no logprob entry
        records = [] if out.is_forced else (out.logprobs or [])
        for k, token_id in enumerate(out.new_token_ids):
            self._held.append((token_id, records[k] if k < len(records) else None))
            self._all_ids.append(token_id)
        ended_by_token = out.finished and out.finish_reason == "stop" and out.stop_token is not None
        if ended_by_token:
            num_stop = len(out.stop_token) if isinstance(out.stop_token, list) else 1
            del self._held[max(0, len(self._held) - num_stop):]
        hold = 0 if out.finished else self._holdback.hold_len(self._all_ids)
        release = self._held[: len(self._held) - hold]
        self._held = self._held[len(self._held) - hold:]
        for token_id, record in release:
            self._emit(token_id, record, delta)
            if self.finished:
                return delta
        if out.finished:
            self._flush(delta)
            if not self.finished:
                self._finish(delta, out.finish_reason or "stop", out.stop_token)
                delta.error = out.error
        return delta

    def _flush(self, delta: OutputDelta) -> None:
        tail = self._detok.flush()
        if tail:
            self._pairs.append([NO_TOKEN, tail, len(tail)])  # held bytes of earlier tokens, decoded at the end
        released, matched = self._feed_stops(tail, delta)
        if matched:
            return
        rest = self._stops.flush()
        delta.text += rest
        self._release(len(released) + len(rest), delta)
        for token_id, text, _ in self._pairs:  # NOTE: nothing visible is held now; hidden specials follow
            delta.tokens.append((token_id, text))
        self._pairs = []
        delta.entries += self._release_entries(None)

    def finish_by_client(self) -> OutputDelta:
        """The stream ended without a terminal record (e.g. abort): release what is held."""
        delta = OutputDelta()
        if not self.finished:
            for token_id, record in self._held:
                self._emit(token_id, record, delta)
            self._held = []
            if not self.finished:
                self._flush(delta)
                self._finish(delta, "abort")
        return delta
