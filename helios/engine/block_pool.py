"""The paged KV block pool: fixed-size pages, a free list, reference counts and the cached-page map.

Owns page ids only (the runner owns the tensors they index). A page holding the KV of a full page of some
request's tokens may carry that page's chained hash (helios/engine/prefix_cache.py): the prefix cache.
A page whose count reaches zero goes back to the free list but keeps its hash, so a later request can still
take it (a hit); allocate() hands out the least recently freed page first and drops its hash (eviction).
With `track_evictions` the pool also lists each eviction (page, hash) for the host tier to store; with an `events`
log (helios/engine/kv_events.py, set by PrefixCache.attach_events) it reports each hash it drops to a router.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from helios.engine.kv_events import KVEventLog


class BlockPool:
    """`num_blocks` pages of `block_size` tokens; ids are 0 .. num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int, track_evictions: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # NOTE: allocate from the front, free to the back, so the least recently freed page is reused
        # first and freed-but-cached pages stay findable for as long as possible. An OrderedDict, not a
        # deque: a hit on a free cached page takes it out of the middle in O(1) (a plain dict would make
        # taking the front O(n) after many deletions there).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_by_hash: dict[bytes, int] = {}
        self._hash_by_block: dict[int, bytes] = {}
        # (page, hash) of every eviction since the last take_evictions(); None when nobody reads them
        self._evictions: list[tuple[int, bytes]] | None = [] if track_evictions else None
        self.events: KVEventLog | None = None  # KV events for a router; None (the default): no cost

    @property
    def num_free_blocks(self) -> int:
        """Pages allocate() can hand out, cached (evictable) ones included."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Pages that carry a hash, in use or free."""
        return len(self._hash_by_block)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free pages, each with reference count 1; a cached one loses its hash."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            raise MemoryError(f"need {num_blocks} KV pages, {len(self._free)} free")
        block_ids = [self._free.popitem(last=False)[0] for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
            block_hash = self._hash_by_block.pop(block_id, None)
            if block_hash is not None:
                del self._block_by_hash[block_hash]
                if self._evictions is not None:
                    self._evictions.append((block_id, block_hash))
                if self.events is not None:
                    self.events.removed(block_hash)
        return block_ids

    def take_evictions(self) -> list[tuple[int, bytes]]:
        """The (page, hash) evictions since the last call, oldest first; the pages still hold that KV until the
        plan that allocated them runs."""
        evictions = self._evictions or []
        if self._evictions is not None:
            self._evictions = []
        return evictions

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share pages: used ones, or free cached ones (a prefix-cache hit takes them off the free list).
        Each holder calls `free` once when done."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count == 0:
                if block_id not in self._hash_by_block:
                    raise ValueError(f"incref of free block {block_id}")
                del self._free[block_id]
            self._ref_counts[block_id] = count + 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each page; pages whose count reaches zero go back to the free list (a
        cached one keeps its hash until allocate() hands it out)."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    # --- the prefix cache ---------------------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: bytes) -> bool:
        """Publish a used page whose KV now holds the full page `block_hash` names; True when it is newly
        cached. A hash that already names another page keeps that page (no dedup); a page already carrying a
        hash keeps it."""
        if self._ref_counts[block_id] <= 0:
            raise ValueError(f"cache_block of free block {block_id}")
        if block_hash in self._block_by_hash or block_id in self._hash_by_block:
            return False
        self._block_by_hash[block_hash] = block_id
        self._hash_by_block[block_id] = block_hash
        return True

    def uncache_block(self, block_id: int) -> None:
        """Drop the page's hash, if any (its KV never arrived: a failed step's copy-in)."""
        block_hash = self._hash_by_block.pop(block_id, None)
        if block_hash is not None:
            del self._block_by_hash[block_hash]
            if self.events is not None:
                self.events.removed(block_hash)

    def block_hash(self, block_id: int) -> bytes | None:
        return self._hash_by_block.get(block_id)

    def find_cached_prefix(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The pages of the longest run of `block_hashes`, from the first, that are all cached. Takes nothing:
        the caller increfs the pages it keeps."""
        block_ids = []
        for block_hash in block_hashes:
            block_id = self._block_by_hash.get(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return block_ids

    def cached_block(self, block_hash: bytes) -> int | None:
        """The page `block_hash` names, if cached (nothing is taken)."""
        return self._block_by_hash.get(block_hash)

    def num_free_among(self, block_ids: Iterable[int]) -> int:
        """How many of these (cached) pages are on the free list: taking them leaves that many fewer free."""
        return sum(1 for block_id in block_ids if self._ref_counts[block_id] == 0)

    def check_invariants(self) -> None:
        """Assert internal consistency (tests and debugging): O(num_blocks)."""
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has reference count {count}"
            is_free = block_id in self._free
            assert (count == 0) == is_free, f"block {block_id}: count {count}, free {is_free}"
        assert all(0 <= b < self.num_blocks for b in self._free), "an unknown block is on the free list"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
        assert len(self._block_by_hash) == len(self._hash_by_block), "the hash maps differ in size"
        for block_hash, block_id in self._block_by_hash.items():
            assert self._hash_by_block.get(block_id) == block_hash, f"block {block_id}: hash maps disagree"
