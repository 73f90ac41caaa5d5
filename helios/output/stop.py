"""Stop matching on the output side: string stops (which may cut inside a token) and token-sequence holdback.

StopMatcher holds back the longest tail that could still begin a stop string, so released text never
contains a stop; TokenSequenceHoldback withholds trailing tokens that could still complete a stop-token
sequence, so a sequence the engine stops on is never streamed. Pure Python.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    """feed(text) -> (released text, matched stop or None); after a match nothing more is accepted."""

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self._max_hold = max((len(s) for s in self.stops), default=1) - 1
        self._buf = ""
        self.num_released = 0  # chars released so far
        self.matched: str | None = None
        self.match_pos: int | None = None  # char position of the stop in the full text

    def feed(self, text: str) -> tuple[str, str | None]:
        if self.matched is not None:
            return "", self.matched
        if not self.stops:
            self.num_released += len(text)
            return text, None
        buf = self._buf + text
        best = None
        for stop in self.stops:
            pos = buf.find(stop)
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is not None:
            pos, stop = best
            self.matched, self.match_pos = stop, self.num_released + pos
            self._buf = ""
            self.num_released += pos
            return buf[:pos], stop
        hold = self._hold_len(buf)
        out = buf[: len(buf) - hold]
        self._buf = buf[len(buf) - hold:]
        self.num_released += len(out)
        return out, None

    def _hold_len(self, buf: str) -> int:
        for k in range(min(len(buf), self._max_hold), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def flush(self) -> str:
        """End of output without a match: release the held tail."""
        out, self._buf = self._buf, ""
        self.num_released += len(out)
        return out


class TokenSequenceHoldback:
    """Withhold the longest token tail that is a proper prefix of a stop sequence (length >= 2)."""

    def __init__(self, sequences: Sequence[Sequence[int]]):
        self.sequences = [tuple(s) for s in sequences if len(s) >= 2]
        self._max_hold = max((len(s) for s in self.sequences), default=1) - 1

    def hold_len(self, tokens: Sequence[int]) -> int:
        if not self.sequences:
            return 0
        for k in range(min(len(tokens), self._max_hold), 0, -1):
            tail = tuple(tokens[-k:])
            if any(s[:k] == tail for s in self.sequences):
                return k
        return 0
