"""The engine's side of structured output: the ConstraintOwner protocol the scheduler asks for token masks.

Grammar state is not kept here: a request carries a ConstraintSpec (plain data, helios/engine/messages.py) and
the owner (helios/frontend/constraints.py, built by the composition root with the model's llguidance
vocabulary) compiles it, folds committed tokens into it and hands back masks as bytes. The scheduler calls the
owner only from the engine thread (the engine takes adds and aborts through an inbox, helios/engine/async_engine.py),
so a mask is computed under no lock the event loop takes. Pure Python: must not import torch, numpy or llguidance.
"""

from __future__ import annotations

from typing import Protocol

from helios.engine.messages import ConstraintSpec


class ConstraintOwner(Protocol):
    """Per-request grammar state, keyed by req_id; every call comes from the engine thread."""

    def open(self, req_id: str, spec: ConstraintSpec) -> None:
        """Compile the request's grammar (a fresh state at its start); ValueError when it cannot be compiled."""

    def observe(self, req_id: str, token_id: int) -> str | None:
        """Fold one committed output token in; returns the request's constraint error (this token refused, or
        an earlier mask that allowed nothing), None while it is within its grammar."""

    def token_mask(self, req_id: str) -> bytes | None:
        """The allowed next tokens as a little-endian bitmask of int32 words (bit i of word w: token 32w+i),
        or None while the grammar does not apply (or has failed: observe() then reports why)."""

    def close(self, req_id: str) -> None:
        """Forget the request (finished or aborted); the state survives preemption, which replays no tokens."""
