"""The host DRAM tier of the prefix cache: which page hash each of `num_slots` host records holds, in LRU order.

Owns the index only (the runner owns the host tensors the slots address, helios/runner/host_cache.py). The
scheduler stores every page the GPU pool evicts (a copy-out, GPU page -> slot) and, at admission, continues a
request's GPU prefix with the pages held here (a copy-in, slot -> fresh GPU page). Pure Python: must not import
torch or numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class HostCache:
    """`num_slots` records of one KV page each, named by their chained page hash; least recently used first."""

    def __init__(self, num_slots: int, page_bytes: int) -> None:
        if num_slots < 1:
            raise ValueError(f"HostCache needs num_slots >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.page_bytes = page_bytes  # bytes one record holds (all layers): the byte counters' unit
        self._slot_by_hash: OrderedDict[bytes, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        # NOTE: slots the plan being built reads (copy-in) or writes (copy-out). None of them may be written again
        # in the same plan: the runner copies every page out before any in, and a slot written twice in one
        # plan (or read after a rewrite) would hand a request another prefix's KV.
        self._pinned: set[int] = set()
        self.num_hits = 0  # admissions that took at least one host page
        self.num_reused_tokens = 0
        self.num_bytes_out = 0
        self.num_bytes_in = 0

    @property
    def num_records(self) -> int:
        return len(self._slot_by_hash)

    def find_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The slots of the longest run of `block_hashes`, from the first, all held here. Takes nothing."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slot_by_hash.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def take(self, block_hashes: Sequence[bytes], num_tokens: int) -> None:
        """An admission copies these held pages in this plan: they become the most recently used and their
        slots are pinned until end_step()."""
        for block_hash in block_hashes:
            self._slot_by_hash.move_to_end(block_hash)
            self._pinned.add(self._slot_by_hash[block_hash])
        self.num_hits += 1
        self.num_reused_tokens += num_tokens
        self.num_bytes_in += len(block_hashes) * self.page_bytes

    def store(self, block_hash: bytes) -> int | None:
        """A page the GPU pool evicted: the slot to copy it into, or None when it is held already (then only
        touched) or every slot is pinned. Takes a free slot, else the least recently used unpinned record's."""
        if block_hash in self._slot_by_hash:
            self._slot_by_hash.move_to_end(block_hash)
            return None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._slot_by_hash.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self._slot_by_hash.pop(victim)
        self._slot_by_hash[block_hash] = slot
        self._pinned.add(slot)
        self.num_bytes_out += self.page_bytes
        return slot

    def discard_slot(self, slot: int) -> None:
        """Forget the record in `slot` (its copy-out may never have run: a failed step)."""
        block_hash = next((h for h, s in self._slot_by_hash.items() if s == slot), None)
        if block_hash is not None:
            del self._slot_by_hash[block_hash]
            self._free_slots.append(slot)

    def end_step(self) -> None:
        """The plan is complete: its pins are released."""
        self._pinned.clear()

    def check_invariants(self) -> None:
        """Assert internal consistency (tests and debugging)."""
        used = list(self._slot_by_hash.values())
        assert len(set(used)) == len(used), "a slot holds two records"
        assert not set(used) & set(self._free_slots), "a free slot holds a record"
        assert len(used) + len(self._free_slots) == self.num_slots, "slots leaked"
        assert all(0 <= s < self.num_slots for s in used + self._free_slots), "an unknown slot"
