"""State checkpoints: prefix reuse for hybrid models, whose recurrent layers cannot resume from KV pages alone.

A checkpoint is an immutable copy of a request's recurrent state (every linear layer's conv and recurrent state:
one state slot, helios.engine.state_pool) at a position p on the grid G = lcm(page size, recurrent chunk), named
by the chained hash of the request's page ending at p (helios.engine.prefix_cache), so it stands for the whole
prefix 0..p. A later request whose first p tokens hash the same, and whose pages up to p are still cached, starts
at p: its running slot is restored from the checkpoint (a slot copy before the plan's forward) and it computes
from p on, exactly as it would have from 0, since every chunk boundary before p lies on the same grid.

Roles (the spec's names): `endpoint`, the last grid position a request's prompt reaches (the scheduler ends a prompt's chunk
there, helios.engine.scheduler._chunk_size) and each one its decode passes (each replacing the request's earlier
decode endpoint, so a conversation's next turn finds the latest);
`anchor` and `message` (a template's stable prefix, message ends) need the frontend's positions and are not
captured yet (their counters stay zero).

The cost rule, per candidate p of role r: capture iff est_prefill_ns(p) * P_REUSE[r] > copy_ns, with
est_prefill_ns(p) = p x the measured prefill time per token (skip `unknown_cost` until one step measured it) and
copy_ns = the slot's bytes over the state copy bandwidth (configured per device; skip `work_budget` when the
copy would cost more than the prefill it is expected to save); a capture also
needs a slot: a free one within the checkpoint share, or the least recently used checkpoint (skip `storage` when
every one is pinned by this very step). The charged extra work (the copy's predicted time) is summed in
`extra_work_ns`. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict

from helios.engine.state_pool import StatePool

ROLES = ("anchor", "message", "endpoint")
SKIP_REASONS = ("unknown_cost", "work_budget", "storage")
P_REUSE = {"anchor": 0.9, "message": 0.5, "endpoint": 0.5}


class StateCheckpoints:
    def __init__(self, pool: StatePool, max_checkpoints: int, slot_bytes: int, copy_bytes_per_s: float) -> None:
        self.pool = pool
        self.max_checkpoints = max_checkpoints
        self.copy_ns = 1e9 * slot_bytes / copy_bytes_per_s if copy_bytes_per_s > 0 else 0.0
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # hash at p -> slot, least recently used first
        self.captures = dict.fromkeys(ROLES, 0)
        self.skips = dict.fromkeys(SKIP_REASONS, 0)
        self.extra_work_ns = 0.0
        self._pinned: set[bytes] = set()  # captured or restored in the plan being built: not evictable
        self.evicted: list[tuple[bytes, int]] = []  # (hash, slot) the LRU rule let go, for the scheduler to take

    @property
    def num_held(self) -> int:
        return len(self.slots)

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of the checkpoint at `block_hash` (touched and pinned for the plan being built), or None."""
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
            self._pinned.add(block_hash)
        return slot

    def capture(self, block_hash: bytes, num_tokens: int, role: str, prefill_ns_per_token: float | None,
                replaces: bytes | None = None) -> int | None:
        """A slot to copy the request's running state into for a checkpoint at num_tokens (its hash), or None
        when the cost rule or storage says no (counted). An existing checkpoint of the same prefix is kept.
        prefill_ns_per_token: the measured prefill rate (Scheduler.observe_prefill), None while unmeasured.
        replaces: the request's earlier checkpoint this one supersedes, dropped once the capture is decided (its
        slot is the first taken)."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            return None
        if prefill_ns_per_token is None:
            self.skips["unknown_cost"] += 1
            return None
        if num_tokens * prefill_ns_per_token * P_REUSE[role] <= self.copy_ns:
            self.skips["work_budget"] += 1
            return None
        if replaces is not None and replaces not in self._pinned:
            self.drop(replaces)
        if len(self.slots) >= self.max_checkpoints or not self.pool.can_allocate():
            victim = next((h for h in self.slots if h not in self._pinned), None)
            if victim is None:
                self.skips["storage"] += 1
                return None
            victim_slot = self.slots.pop(victim)
            self.evicted.append((victim, victim_slot))  # the scheduler may keep it in a host tier
            self.pool.free(victim_slot)
        slot = self.pool.allocate()
        self.slots[block_hash] = slot
        self._pinned.add(block_hash)
        self.captures[role] += 1
        self.extra_work_ns += self.copy_ns
        return slot

    def drop(self, block_hash: bytes) -> None:
        """Forget a checkpoint (its capture never ran, or a request replaced its own endpoint)."""
        slot = self.slots.pop(block_hash, None)
        if slot is not None:
            self.pool.free(slot)

    def forget_slots(self, slots: set[int]) -> None:
        """A plan failed: the checkpoints its copies were filling are dropped."""
        for block_hash in [h for h, slot in self.slots.items() if slot in slots]:
            self.drop(block_hash)

    def end_step(self) -> None:
        self._pinned.clear()
