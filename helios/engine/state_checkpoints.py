"""State checkpoints: prefix reuse for hybrid models, whose recurrent layers cannot resume from KV pages alone.

A checkpoint is an immutable copy of a request's recurrent state (every linear layer's conv and recurrent state:
one state slot, helios.engine.state_pool) at a position p on the grid G = lcm(page size, recurrent chunk), named
by the chained hash of the request's page ending at p (helios.engine.prefix_cache), so it stands for the whole
prefix 0..p. A later request whose first p tokens hash the same, and whose pages up to p are still cached, starts
at p: its running slot is restored from the checkpoint (a slot copy before the plan's forward) and it computes
from p on, exactly as it would have from 0, since every chunk boundary before p lies on the same grid.

Roles (the spec's names, helios/engine/README.md "State checkpoints"): `endpoint`, the last grid position a
request's prompt reaches (the scheduler ends a prompt's chunk there, helios.engine.scheduler._chunk_size) and each
one its decode passes (each replacing the request's earlier decode endpoint, so a conversation's next turn finds the
latest); `anchor`, the end of the prompt's stable prefix (the leading system message with the tools: every
conversation under the same instructions shares it) and `message`, the end of a chat message, both token offsets
from the rendered template (EngineRequest.anchor_end / message_ends, helios/frontend/boundaries.py) rounded down to
the grid and chosen at admission (`select`); the scheduler ends a chunk at each chosen one.

The cost rule, per candidate p of role r: capture iff est_prefill_ns(p) * P_REUSE[r] > copy_ns, with
est_prefill_ns(p) = p x the measured prefill time per token (skip `unknown_cost` until one step measured it) and
copy_ns = the slot's bytes over the state copy bandwidth (configured per device; skip `work_budget` when the
copy would cost more than the prefill it is expected to save). A request's anchor and message copies together are
also held to WORK_ALLOWANCE of its own predicted prefill (the anchor first, then the latest messages; `work_budget`
for the rest). A capture needs a slot: a free one within the checkpoint share, or the least recently used
checkpoint's, anchors last (skip `storage` when every one is pinned by this very step). An anchor chosen at
admission takes its slot then (an anchor guard, `guards`), so its capture cannot fail for storage later; the guard
goes back if the request ends or is preempted before it gets there. The charged extra work (the copy's predicted
time; a chunk cut on the grid adds no predicted prefill work, the recurrent layers chunk there anyway) is summed in
`extra_work_ns`. Pure Python.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from helios.engine.state_pool import StatePool

ROLES = ("anchor", "message", "endpoint")
SKIP_REASONS = ("unknown_cost", "work_budget", "storage")
P_REUSE = {"anchor": 0.9, "message": 0.5, "endpoint": 0.5}
WORK_ALLOWANCE = 0.05  # a request's anchor and message copies may cost this share of its predicted prefill


def candidate_positions(anchor_end: int, message_ends: Sequence[int], start: int, last: int,
                        grid: int) -> dict[int, str]:
    """The grid positions (-> role) of a prompt's anchor and message ends strictly after `start` (what the request
    reused) and before `last` (its endpoint's position, captured anyway); an anchor wins a position it shares."""
    out: dict[int, str] = {}
    for end, role in [(anchor_end, "anchor"), *((m, "message") for m in message_ends)]:
        p = end // grid * grid
        if start < p < last:
            out.setdefault(p, role)
    return out


class StateCheckpoints:
    def __init__(self, pool: StatePool, max_checkpoints: int, slot_bytes: int, copy_bytes_per_s: float) -> None:
        self.pool = pool
        self.max_checkpoints = max_checkpoints
        self.copy_ns = 1e9 * slot_bytes / copy_bytes_per_s if copy_bytes_per_s > 0 else 0.0
        self.slots: OrderedDict[bytes, int] = OrderedDict()  # hash at p -> slot, least recently used first
        self.roles: dict[bytes, str] = {}  # hash -> the role it was captured for (anchors are evicted last)
        # anchor guards: hash -> the slot set aside at admission for an anchor a running request will reach
        self.guards: dict[bytes, int] = {}
        self.captures = dict.fromkeys(ROLES, 0)
        self.skips = dict.fromkeys(SKIP_REASONS, 0)
        self.extra_work_ns = 0.0
        self._pinned: set[bytes] = set()  # captured or restored in the plan being built: not evictable
        self.evicted: list[tuple[bytes, int]] = []  # (hash, slot) the LRU rule let go, for the scheduler to take

    @property
    def num_held(self) -> int:
        return len(self.slots)

    @property
    def num_guards(self) -> int:
        """Anchor guards not used yet (/metrics' flare_checkpoint_anchor_reservations): a guard whose capture is
        decided is a checkpoint (its copy in the next plan), no longer a guard."""
        return len(self.guards)

    def holds(self, block_hash: bytes) -> bool:
        """A checkpoint or a guard of this prefix exists (nothing to select for it)."""
        return block_hash in self.slots or block_hash in self.guards

    def lookup(self, block_hash: bytes) -> int | None:
        """The slot of the checkpoint at `block_hash` (touched and pinned for the plan being built), or None."""
        slot = self.slots.get(block_hash)
        if slot is not None:
            self.slots.move_to_end(block_hash)
            self._pinned.add(block_hash)
        return slot

    def select(self, candidates: dict[int, str], num_new_tokens: int,
               prefill_ns_per_token: float | None) -> tuple[dict[int, str], list[str]]:
        """The cost rule over a request's anchor and message candidates (position -> role): those it takes, and
        the skip reason of each other one. Decides only: the caller counts the skips (skip()) once the request is
        admitted. num_new_tokens: the prompt tokens the request computes (its work allowance's base)."""
        if not candidates:
            return {}, []
        if prefill_ns_per_token is None:
            return {}, ["unknown_cost"] * len(candidates)
        allowance = WORK_ALLOWANCE * num_new_tokens * prefill_ns_per_token
        chosen: dict[int, str] = {}
        skipped: list[str] = []
        spent = 0.0
        # the anchor first (shared by every conversation under the same instructions), then the latest messages
        for p in sorted(candidates, key=lambda p: (candidates[p] != "anchor", -p)):
            role = candidates[p]
            if p * prefill_ns_per_token * P_REUSE[role] <= self.copy_ns or spent + self.copy_ns > allowance:
                skipped.append("work_budget")
                continue
            chosen[p] = role
            spent += self.copy_ns
        return chosen, skipped

    def skip(self, reasons: Sequence[str]) -> None:
        for reason in reasons:
            self.skips[reason] += 1

    def reserve(self, block_hash: bytes) -> bool:
        """An anchor guard for `block_hash`: a slot of the share set aside now (False, counted `storage`, when
        every checkpoint is pinned). One guard per prefix: a second request under the same anchor needs none."""
        if self.holds(block_hash):
            return True
        slot = self._take_slot()
        if slot is None:
            self.skips["storage"] += 1
            return False
        self.guards[block_hash] = slot
        return True

    def release(self, block_hash: bytes) -> None:
        """The guard of a request that ended (or was preempted) before its anchor goes back; no-op once used."""
        slot = self.guards.pop(block_hash, None)
        if slot is not None:
            self.pool.free(slot)

    def capture(self, block_hash: bytes, num_tokens: int, role: str, prefill_ns_per_token: float | None,
                replaces: bytes | None = None, is_selected: bool = False) -> int | None:
        """A slot to copy the request's running state into for a checkpoint at num_tokens (its hash), or None
        when the cost rule or storage says no (counted). An existing checkpoint of the same prefix is kept.
        prefill_ns_per_token: the measured prefill rate (Scheduler.observe_prefill), None while unmeasured.
        replaces: the request's earlier checkpoint this one supersedes, dropped once the capture is decided (its
        slot is the first taken). is_selected: select() took it already (no second cost decision); an anchor's
        guard, when it holds one, is the slot."""
        if block_hash in self.slots:
            self.slots.move_to_end(block_hash)
            self.release(block_hash)
            return None
        slot = self.guards.pop(block_hash, None)
        if slot is None:
            if not is_selected and not self._is_worth(num_tokens, role, prefill_ns_per_token):
                return None
            if replaces is not None and replaces not in self._pinned:
                self.drop(replaces)
            slot = self._take_slot()
            if slot is None:
                self.skips["storage"] += 1
                return None
        self.slots[block_hash] = slot
        self.roles[block_hash] = role
        self._pinned.add(block_hash)
        self.captures[role] += 1
        self.extra_work_ns += self.copy_ns
        return slot

    def _is_worth(self, num_tokens: int, role: str, prefill_ns_per_token: float | None) -> bool:
        """The cost rule for one capture decided at capture time (endpoints); a no is counted."""
        if prefill_ns_per_token is None:
            self.skips["unknown_cost"] += 1
            return False
        if num_tokens * prefill_ns_per_token * P_REUSE[role] <= self.copy_ns:
            self.skips["work_budget"] += 1
            return False
        return True

    def _take_slot(self) -> int | None:
        """A slot of the checkpoint share: a free one, else the least recently used unpinned checkpoint's (a
        message or endpoint before any anchor), which goes to `evicted`; None when every one is pinned."""
        if len(self.slots) + len(self.guards) >= self.max_checkpoints or not self.pool.can_allocate():
            unpinned = [h for h in self.slots if h not in self._pinned]
            victim = next((h for h in unpinned if self.roles.get(h) != "anchor"), None) or next(iter(unpinned), None)
            if victim is None:
                return None
            victim_slot = self.slots.pop(victim)
            self.roles.pop(victim, None)
            self.evicted.append((victim, victim_slot))  # the scheduler may keep it in a host tier
            self.pool.free(victim_slot)
        return self.pool.allocate()

    def drop(self, block_hash: bytes) -> None:
        """Forget a checkpoint (its capture never ran, or a request replaced its own endpoint)."""
        slot = self.slots.pop(block_hash, None)
        self.roles.pop(block_hash, None)
        if slot is not None:
            self.pool.free(slot)

    def forget_slots(self, slots: set[int]) -> None:
        """A plan failed: the checkpoints its copies were filling are dropped."""
        for block_hash in [h for h, slot in self.slots.items() if slot in slots]:
            self.drop(block_hash)

    def end_step(self) -> None:
        self._pinned.clear()
