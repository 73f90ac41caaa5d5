"""The output constraint of one request (structured output): which tokens the next sample may take.

Owns when a request's grammar applies and the allowed-token mask the runner applies before sampling. The
frontend compiles the grammar into a matcher at admission (helios/frontend/grammar.py); here it only advances
on generated ids. The grammar constrains the final answer: while the prompt left output inside reasoning it
waits for the reasoning close token, and at the answer's first token a single-token tool opener (the
tool-call envelope) is allowed as well and releases the request from the grammar. Pure Python: must not
import torch or numpy; the matcher is llguidance's LLMatcher, used through its methods only.
"""

from __future__ import annotations

from typing import Any

from msgspec import Struct


class OutputConstraint(Struct, frozen=True, kw_only=True):
    """A compiled output grammar and the envelopes around it, resolved by the frontend for one request."""

    matcher: Any  # llguidance.LLMatcher at its start state, over the model's vocabulary (not shared)
    starts_in_reasoning: bool = False  # output opens inside reasoning: the grammar starts after close_token_id
    close_token_id: int | None = None  # the prepared single-token reasoning close delimiter
    tool_open_token_ids: tuple[int, ...] = ()  # single-token tool openers allowed in place of the answer


class ConstraintState:
    """Where one request stands against its constraint, from its output ids; survives preemption."""

    __slots__ = ("constraint", "phase", "num_answer_tokens", "error")

    def __init__(self, constraint: OutputConstraint) -> None:
        self.constraint = constraint
        # "reasoning": before the close token (unconstrained); "answer": under the grammar; "released": a tool
        # call took the answer's place (unconstrained to the end)
        self.phase = "reasoning" if constraint.starts_in_reasoning and constraint.close_token_id is not None \
            else "answer"
        self.num_answer_tokens = 0
        self.error: str | None = None

    def observe(self, token_id: int) -> None:
        """Fold one appended output token into the state; a token the grammar refuses sets `error`."""
        if self.phase == "reasoning":
            if token_id == self.constraint.close_token_id:
                self.phase = "answer"
            return
        if self.phase != "answer" or self.error is not None:
            return
        if self.num_answer_tokens == 0 and token_id in self.constraint.tool_open_token_ids:
            self.phase = "released"
            return
        self.num_answer_tokens += 1
        matcher = self.constraint.matcher
        if not matcher.consume_token(token_id):
            self.error = f"the output constraint refused token {token_id}: {_first_line(matcher.get_error())}"

    def token_mask(self) -> bytes | None:
        """The allowed next tokens as a little-endian bitmask of int32 words (bit i of word w: token 32w+i),
        or None while the grammar does not apply."""
        if self.phase != "answer" or self.error is not None:
            return None
        mask = self.constraint.matcher.compute_bitmask()
        if self.num_answer_tokens == 0 and self.constraint.tool_open_token_ids:
            words = bytearray(mask)
            for t in self.constraint.tool_open_token_ids:
                if 0 <= t < 8 * len(words):
                    words[t >> 3] |= 1 << (t & 7)
            mask = bytes(words)
        if not any(mask):
            self.error = f"the output constraint allows no token: {_first_line(self.constraint.matcher.get_error())}"
            return None
        return mask


def _first_line(message: str) -> str:
    lines = (message or "").strip().splitlines()
    return lines[0] if lines else "no further detail"
