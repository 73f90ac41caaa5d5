"""State slots: the per-request recurrent state of a hybrid model's linear layers (helios.layers.recurrent).

A slot is one row of every recurrent layer's state tensors in the runner (conv and recurrent state, a fixed size
per request whatever its length). A running request holds one from admission to its end (finish, abort,
preemption); chunked prefill simply continues it, each chunk reading the state the last one left. The runner
reads a slot only for a request with computed tokens, so a fresh request needs no reset of its slot.
Pure Python.
"""

from __future__ import annotations


class StatePool:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        # lowest ids first: a quiet server keeps touching the same few rows
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def can_allocate(self) -> bool:
        return bool(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise RuntimeError("no free state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"state slot {slot} is not held")
        self._free.append(slot)
