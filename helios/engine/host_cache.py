"""The host DRAM tier of the prefix cache: which page hash each of `num_slots` host records holds, in LRU order.

Owns the index only (the runner owns the host tensors the slots address, helios/runner/host_cache.py). The
scheduler stores every page the GPU pool evicts (a copy-out, GPU page -> slot) and, at admission, continues a
request's GPU prefix with the pages held here (a copy-in, slot -> fresh GPU page). Pure Python: must not import
torch or numpy.

With `num_disk_records` a disk tier stands behind it (records are files named by their hash, in a directory the
runner owns, helios/runner/disk_cache.py): a DRAM record whose slot is reused is spilled to disk (plan `spill`,
LRU drops `disk_drop`), and an admission continues through disk records by loading each into a DRAM slot (plan
`load`) and copying it in as usual. The disk index survives restarts (seed_disk).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

TIERS = ("dram", "nvme")  # /metrics' tier labels: the DRAM records and the disk tier's record files
# why a record left a tier (flare_host_cache_dropped_total{tier,reason}): end_of_chain, the least recently used
# record made room for another (a lookup's chain now ends before it); io_error, a disk record a failed load named;
# oversize never happens here (every record is one page or one state slot, and compose sizes the tiers in records)
DROP_REASONS = ("end_of_chain", "oversize", "io_error")


class LookupHistograms:
    """The three histograms of host prefix-store lookups (spec /metrics): per admission that looked past the GPU,
    the tokens still to compute, the predicted copy-in time of what the host tiers held, and the predicted
    prefill time of the missing tokens (the measured prefill rate; unobserved until one exists)."""

    TOKEN_BOUNDS = [16.0, 64.0, 256.0, 1024.0, 4096.0, 16384.0, 65536.0]
    NS_BOUNDS = [1e5, 1e6, 1e7, 1e8, 1e9, 1e10]

    def __init__(self) -> None:
        self.missing_tokens = self._empty(self.TOKEN_BOUNDS)
        self.transfer_ns = self._empty(self.NS_BOUNDS)
        self.prefill_ns = self._empty(self.NS_BOUNDS)

    @staticmethod
    def _empty(bounds: list[float]) -> dict:
        return {"bounds": bounds, "counts": [0] * (len(bounds) + 1), "sum": 0.0, "count": 0}

    @staticmethod
    def _observe(h: dict, value: float) -> None:
        i = next((i for i, b in enumerate(h["bounds"]) if value <= b), len(h["bounds"]))
        h["counts"][i] += 1
        h["sum"] += value
        h["count"] += 1

    def observe(self, missing_tokens: int, transfer_ns: float, prefill_ns: float | None) -> None:
        self._observe(self.missing_tokens, missing_tokens)
        self._observe(self.transfer_ns, transfer_ns)
        if prefill_ns is not None:
            self._observe(self.prefill_ns, prefill_ns)


class HostCache:
    """`num_slots` records of one KV page each, named by their chained page hash; least recently used first."""

    def __init__(self, num_slots: int, page_bytes: int, num_disk_records: int = 0) -> None:
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
        # the disk tier: hashes of the record files, least recently used first; those this plan loads are pinned
        self.num_disk_records_max = num_disk_records
        self._disk: OrderedDict[bytes, None] = OrderedDict()
        self._disk_pinned: set[bytes] = set()
        # the disk operations of the plan being built (drops may wait for a later plan: see forget_disk_ops)
        self._spill: list[tuple[int, bytes]] = []  # (slot, hash): the slot's record to a file, before it is reused
        self._disk_drop: list[bytes] = []  # files to delete
        self._load: list[tuple[bytes, int]] = []  # (hash, slot): a file into a DRAM slot
        self.num_hits = 0  # admissions that took at least one host page
        self.num_reused_tokens = 0
        self.num_bytes_out = 0
        self.num_bytes_in = 0
        # host retention (spec "Host retention"): records each tier took, records each let go by reason, and
        # offers store() turned down (the hash held already, or every slot pinned by this plan)
        self.num_held = dict.fromkeys(TIERS, 0)
        self.num_dropped = {tier: dict.fromkeys(DROP_REASONS, 0) for tier in TIERS}
        self.num_store_skipped = 0

    @property
    def num_records(self) -> int:
        return len(self._slot_by_hash)

    @property
    def num_disk_records(self) -> int:
        return len(self._disk)

    @property
    def num_parked(self) -> int:
        """Whole DRAM records waiting for their disk write: spills decided but not yet carried by a plan (a plan
        without work carries none; flare_host_cache_parked_records)."""
        return len(self._spill)

    def find_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The slots of the longest run of `block_hashes`, from the first, all held here. Takes nothing."""
        slots = []
        for block_hash in block_hashes:
            slot = self._slot_by_hash.get(block_hash)
            if slot is None:
                break
            slots.append(slot)
        return slots

    def find_tiered_prefix(self, block_hashes: Sequence[bytes]) -> list[int | None]:
        """The longest run of `block_hashes` held in DRAM (its slot) or on disk (None). Takes nothing.

        NOTE: each disk record needs a DRAM slot of its own this plan (free, or an unpinned record's that is not
        part of this run), so the run stops where the slots would run out."""
        entries: list[int | None] = []
        num_spare = len(self._free_slots) + self.num_records - len(self._pinned)
        num_loads = num_dram_unpinned = 0
        for block_hash in block_hashes:
            slot = self._slot_by_hash.get(block_hash)
            if slot is not None:
                num_dram_unpinned += slot not in self._pinned
            elif block_hash in self._disk:
                num_loads += 1
            else:
                break
            if num_loads > num_spare - num_dram_unpinned:
                break
            entries.append(slot)
        return entries

    def take(self, block_hashes: Sequence[bytes], num_tokens: int,
             entries: Sequence[int | None] | None = None) -> list[int]:
        """An admission copies these pages in this plan: DRAM records become the most recently used, disk records
        (entry None) are loaded into a slot each; every slot is pinned until end_step(). Returns the slots."""
        entries = list(entries) if entries is not None else [self._slot_by_hash[h] for h in block_hashes]
        for block_hash, slot in zip(block_hashes, entries):  # pin first: the loads below take unpinned slots
            if slot is None:
                self._disk.move_to_end(block_hash)
                self._disk_pinned.add(block_hash)
            else:
                self._slot_by_hash.move_to_end(block_hash)
                self._pinned.add(slot)
        slots = []
        for block_hash, slot in zip(block_hashes, entries):
            if slot is None:
                slot = self._take_slot()
                assert slot is not None, "find_tiered_prefix counted a slot for every load"
                self._slot_by_hash[block_hash] = slot
                self._pinned.add(slot)
                self._load.append((block_hash, slot))
            slots.append(slot)
        self.num_hits += 1
        self.num_reused_tokens += num_tokens
        self.num_bytes_in += len(block_hashes) * self.page_bytes
        return slots

    def store(self, block_hash: bytes) -> int | None:
        """A page the GPU pool evicted: the slot to copy it into, or None when it is held already (then only
        touched) or every slot is pinned. Takes a free slot, else the least recently used unpinned record's."""
        if block_hash in self._slot_by_hash:
            self._slot_by_hash.move_to_end(block_hash)
            self.num_store_skipped += 1
            return None
        slot = self._take_slot()
        if slot is None:
            self.num_store_skipped += 1
            return None
        self._slot_by_hash[block_hash] = slot
        self._pinned.add(slot)
        self.num_bytes_out += self.page_bytes
        self.num_held["dram"] += 1
        return slot

    def _take_slot(self) -> int | None:
        """A free slot, else the least recently used unpinned record's (spilled to disk), else None."""
        if self._free_slots:
            return self._free_slots.pop()
        victim = next((h for h, s in self._slot_by_hash.items() if s not in self._pinned), None)
        if victim is None:
            return None
        slot = self._slot_by_hash.pop(victim)
        self._spill_record(slot, victim)
        return slot

    def _spill_record(self, slot: int, block_hash: bytes) -> None:
        """The record in `slot` leaves DRAM: onto disk, unless the disk tier is off (or every disk record is
        pinned: then it is lost) or holds it already."""
        if block_hash in self._disk:
            self._disk.move_to_end(block_hash)
            return
        if self.num_disk_records_max == 0 or (len(self._disk) >= self.num_disk_records_max and not self._drop_lru()):
            self.num_dropped["dram"]["end_of_chain"] += 1
            return
        self._disk[block_hash] = None
        self._spill.append((slot, block_hash))
        self.num_held["nvme"] += 1
        if block_hash in self._disk_drop:  # NOTE: the runner deletes after it writes: a stale drop would win
            self._disk_drop.remove(block_hash)

    def _drop_lru(self) -> bool:
        victim = next((h for h in self._disk if h not in self._disk_pinned), None)
        if victim is None:
            return False
        del self._disk[victim]
        self.num_dropped["nvme"]["end_of_chain"] += 1
        # a spill of it in this plan is not needed after all; the drop stays (an older file may be there)
        self._spill = [(s, h) for s, h in self._spill if h != victim]
        self._disk_drop.append(victim)
        return True

    def seed_disk(self, block_hashes: Sequence[bytes]) -> None:
        """The record files found at start-up, least recently used first; those beyond capacity are dropped."""
        for block_hash in block_hashes:
            if self.num_disk_records_max == 0:
                self._disk_drop.append(block_hash)
                continue
            self._disk[block_hash] = None
            self._disk.move_to_end(block_hash)
            if len(self._disk) > self.num_disk_records_max:
                self._drop_lru()

    def take_disk_ops(self) -> tuple[list[tuple[int, bytes]], list[bytes], list[tuple[bytes, int]]]:
        """The plan's (spill, disk_drop, load), emptied here."""
        ops = (self._spill, self._disk_drop, self._load)
        self._spill, self._disk_drop, self._load = [], [], []
        return ops

    def forget_disk_ops(self, spill: Sequence[tuple[int, bytes]], disk_drop: Sequence[bytes],
                        load: Sequence[tuple[bytes, int]], is_io_error: bool = False) -> None:
        """A plan failed, any of its disk operations may or may not have run: spilled records are forgotten and
        their files (if written) deleted by a later plan, its drops are sent again, and the records it loaded
        are forgotten in DRAM and on disk (an unreadable file would fail every later admission that loads it).
        is_io_error: the runner failed the plan for a disk read (its loads are counted dropped, io_error)."""
        if is_io_error:
            self.num_dropped["nvme"]["io_error"] += sum(h in self._disk for h, _ in load)
        for _, block_hash in spill:
            self._disk.pop(block_hash, None)
        for _, slot in load:
            self.discard_slot(slot)
        for block_hash, _ in load:
            self._disk.pop(block_hash, None)
        for block_hash in [h for _, h in spill] + list(disk_drop) + [h for h, _ in load]:
            if block_hash not in self._disk and block_hash not in self._disk_drop:
                self._disk_drop.append(block_hash)

    def discard_slot(self, slot: int) -> None:
        """Forget the record in `slot` (its copy-out may never have run: a failed step)."""
        block_hash = next((h for h, s in self._slot_by_hash.items() if s == slot), None)
        if block_hash is not None:
            del self._slot_by_hash[block_hash]
            self._free_slots.append(slot)

    def end_step(self) -> None:
        """The plan is complete: its pins are released."""
        self._pinned.clear()
        self._disk_pinned.clear()

    def check_invariants(self) -> None:
        """Assert internal consistency (tests and debugging)."""
        used = list(self._slot_by_hash.values())
        assert len(set(used)) == len(used), "a slot holds two records"
        assert not set(used) & set(self._free_slots), "a free slot holds a record"
        assert len(used) + len(self._free_slots) == self.num_slots, "slots leaked"
        assert all(0 <= s < self.num_slots for s in used + self._free_slots), "an unknown slot"
        assert len(self._disk) <= self.num_disk_records_max or not self._disk, "disk index over capacity"
        assert not set(self._disk) & set(self._disk_drop), "a disk record pending deletion"
