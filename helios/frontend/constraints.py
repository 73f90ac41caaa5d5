"""The constraint owner: structured output's grammar state per request, handing the engine plain masks.

Owns one llguidance matcher per constrained request (a deep copy of its grammar's start state; start states are
compiled once per grammar text by the compile function it is given, OutputCompiler.matcher), the phase around it
(the grammar waits for the reasoning close, a single-token tool opener may take the answer's place) and its error.
It satisfies helios.engine.constraint.ConstraintOwner; the composition root builds it with the model's llguidance
vocabulary and hands it to the engine core. NOTE: every call comes from the engine thread (adds and aborts reach
it through the engine's inbox), so a mask is computed under no lock the event loop takes. No torch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from helios.engine.messages import ConstraintSpec
from helios.frontend.sampling import InvalidRequest


class ConstraintState:
    """Where one request stands against its grammar, from its committed output ids; survives preemption (the
    engine recomputes KV then, it never replays tokens through the grammar)."""

    __slots__ = ("spec", "matcher", "phase", "num_answer_tokens", "error", "tail")

    def __init__(self, spec: ConstraintSpec, matcher: Any) -> None:
        self.spec = spec
        self.matcher = matcher  # llguidance.LLMatcher at its start state, this request's own
        # "reasoning": before the close (unconstrained); "answer": under the grammar; "released": a tool call
        # took the answer's place (unconstrained to the end)
        closes = spec.close_token_id is not None or bool(spec.close_token_ids)
        self.phase = "reasoning" if spec.starts_in_reasoning and closes else "answer"
        self.num_answer_tokens = 0
        self.error: str | None = None
        self.tail: list[int] = []  # the last reasoning ids, as many as a close of several tokens has

    def observe(self, token_id: int) -> None:
        """Fold one appended output token into the state; a token the grammar refuses sets `error`."""
        if self.phase == "reasoning":
            if self._closes_reasoning(token_id):
                self.phase = "answer"
            return
        if self.phase != "answer" or self.error is not None:
            return
        if self.num_answer_tokens == 0 and token_id in self.spec.tool_open_token_ids:
            self.phase = "released"
            return
        self.num_answer_tokens += 1
        if not self.matcher.consume_token(token_id):
            self.error = f"the output constraint refused token {token_id}: {_first_line(self.matcher.get_error())}"

    def _closes_reasoning(self, token_id: int) -> bool:
        sequence = self.spec.close_token_ids
        if not sequence:
            return token_id == self.spec.close_token_id
        self.tail.append(token_id)
        del self.tail[: -len(sequence)]
        return tuple(self.tail) == sequence

    def token_mask(self) -> bytes | None:
        """The allowed next tokens as a little-endian bitmask of int32 words (bit i of word w: token 32w+i),
        or None while the grammar does not apply."""
        if self.phase != "answer" or self.error is not None:
            return None
        mask = self.matcher.compute_bitmask()
        if self.num_answer_tokens == 0 and self.spec.tool_open_token_ids:
            words = bytearray(mask)
            for t in self.spec.tool_open_token_ids:
                if 0 <= t < 8 * len(words):
                    words[t >> 3] |= 1 << (t & 7)
            mask = bytes(words)
        if not any(mask):
            self.error = f"the output constraint allows no token: {_first_line(self.matcher.get_error())}"
            return None
        return mask


class GrammarConstraints:
    """helios.engine.constraint.ConstraintOwner over llguidance: one ConstraintState per open request."""

    def __init__(self, matcher: Callable[[str], Any]) -> None:
        """matcher: a fresh llguidance matcher at the start state of a serialized grammar (InvalidRequest when
        it does not compile), e.g. OutputCompiler.matcher."""
        self._matcher = matcher
        self._states: dict[str, ConstraintState] = {}

    def __len__(self) -> int:
        return len(self._states)

    def open(self, req_id: str, spec: ConstraintSpec) -> None:
        try:
            matcher = self._matcher(spec.grammar)
        except InvalidRequest as e:  # the engine's refusal is a ValueError (a 400 with the same text)
            raise ValueError(e.message) from None
        self._states[req_id] = ConstraintState(spec, matcher)

    def observe(self, req_id: str, token_id: int) -> str | None:
        state = self._states[req_id]
        state.observe(token_id)
        return state.error

    def token_mask(self, req_id: str) -> bytes | None:
        return self._states[req_id].token_mask()

    def close(self, req_id: str) -> None:
        self._states.pop(req_id, None)


def _first_line(message: str) -> str:
    lines = (message or "").strip().splitlines()
    return lines[0] if lines else "no further detail"
