"""Per-choice output pipeline: EngineOutput -> neutral deltas (text, logprob entries, finish cause).

Order per token: token-sequence holdback -> incremental detokenizer -> string stop matcher. A terminating
EOS or token stop is hidden from text and logprobs; a token partly clipped by a string stop keeps its entry
and full bytes, tokens entirely beyond it have none (spec: "Generation log probabilities"). Protocol
encoders turn the deltas into their JSON. No torch, no server imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from msgspec import Struct

from helios.engine.messages import EngineOutput, PositionLogprobs, SamplingParams, TokenLogprob
from helios.output.detokenizer import IncrementalDetokenizer
from helios.output.stop import StopMatcher, TokenSequenceHoldback

NON_FINITE_LOGPROB = -9999.0


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
    num_new_tokens: int = 0  # native tokens generated in this step (including hidden stop tokens)
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

    def _emit(self, token_id: int, record: PositionLogprobs | None, delta: OutputDelta) -> None:
        offset = self._detok.num_chars
        piece = self._detok.push(token_id)
        entry = self._entry(token_id, record, offset)
        if entry is not None:
            self._entries.append(entry)
        released, matched = self._stops.feed(piece)
        delta.text += released
        if matched is not None:
            self._finish(delta, "stop", matched)
            delta.entries += self._release_entries(self._stops.match_pos)
            self._entries = []
        elif not self._stops.stops:
            delta.entries += self._release_entries(None)
        else:
            delta.entries += self._release_entries(self._stops.num_released)

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
        delta = OutputDelta(num_new_tokens=len(out.new_token_ids), prompt_logprobs=out.prompt_logprobs)
        self.num_generated += len(out.new_token_ids)
        if out.num_prompt_tokens:
            self.num_prompt_tokens = out.num_prompt_tokens
            self.num_cached_tokens = out.num_cached_tokens
        if self.finished:
            return delta
        records = out.logprobs or []
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
        released, matched = self._stops.feed(self._detok.flush())
        delta.text += released
        if matched is not None:
            self._finish(delta, "stop", matched)
            delta.entries += self._release_entries(self._stops.match_pos)
            self._entries = []
            return
        delta.text += self._stops.flush()
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
