"""Automatic prefix caching (vLLM v1 style): which of a request's KV pages it can reuse, and which it publishes.

A full page of token ids is named by a chained hash of its tokens and its parent page's hash, so equal
hashes mean equal whole prefixes. The hash <-> page map and eviction live in the BlockPool; this module
computes the hashes, looks a request's prefix up at admission (the GPU pages, then the host tier's records in
DRAM or on disk, helios/engine/host_cache.py) and publishes its pages once computed. A model with window groups
(helios/engine/kv_groups.py) publishes each group's pages under the same hashes, in the group's own pool; a hit
must find group 0's pages and, in each window group, the pages inside the window of the hit's end. With KV events
on (attach_events) group 0's newly cached pages and dropped hashes are logged for a router (helios/engine/kv_events.py).
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from helios.engine.block_pool import BlockPool
from helios.engine.host_cache import HostCache
from helios.engine.kv_events import KVEventLog
from helios.engine.kv_groups import NULL_PAGE, WindowGroup
from helios.engine.request import Request

ROOT_HASH = b""  # the parent of a request's first page


def hash_page(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """The name of one full page: blake2b over the parent's hash and the page's token ids (int64).

    NOTE: a cryptographic hash, not Python's hash() of a tuple: a hit hands one request another request's
    KV, so a collision (which a client could craft against the 64-bit, non-cryptographic tuple hash) would
    leak or corrupt text across requests. It is also stable across processes, for a later host/disk tier.
    About 1 us a page. The parent is 0 or 32 bytes and the page a fixed size, so inputs never alias.
    """
    return hashlib.blake2b(parent_hash + array("q", token_ids).tobytes(), digest_size=32).digest()


def extend_page_hashes(page_hashes: list[bytes], token_ids: Sequence[int], page_size: int, num_pages: int) -> None:
    """Grow `page_hashes` (the hashes of the first pages of `token_ids`) to its first `num_pages` full pages."""
    assert num_pages * page_size <= len(token_ids), (num_pages, page_size, len(token_ids))
    parent = page_hashes[-1] if page_hashes else ROOT_HASH
    for i in range(len(page_hashes), num_pages):
        parent = hash_page(parent, token_ids[i * page_size : (i + 1) * page_size])
        page_hashes.append(parent)


class PrefixCache:
    """The scheduler's side of the prefix cache over one BlockPool (the pool keeps the hash <-> page map)."""

    def __init__(self, pool: BlockPool, host: HostCache | None = None, groups: Sequence[WindowGroup] = ()) -> None:
        self.pool = pool
        self.page_size = pool.block_size
        self.host = host
        self.groups = list(groups)  # window groups: their own pools, the same hashes
        self.events: KVEventLog | None = None  # KV events for a router (attach_events); None: off, no cost

    def attach_events(self, events: KVEventLog) -> None:
        """Log group 0's cache changes from now on: pages this cache publishes (BlockStored) and hashes the pool
        drops (BlockRemoved). Window groups and the host tiers report nothing (see helios/server/README.md)."""
        self.events = self.pool.events = events

    def match(self, req: Request) -> list[int]:
        """Cached pages a waiting request can start from (nothing is taken: the caller increfs them).

        NOTE: at most (num_tokens - 1) // page_size pages, so at least one token is computed (it yields the
        logits to sample from) and the page it lands in is a fresh one: a shared page is never written.
        A request still owing prompt logprobs reuses nothing: those need the logits of every prompt position.
        """
        if req.wants_prompt_logprobs:
            return []
        num_pages = (req.num_tokens - 1) // self.page_size
        extend_page_hashes(req.page_hashes, req.all_token_ids, self.page_size, num_pages)
        return self.pool.find_cached_prefix(req.page_hashes[:num_pages])

    def match_windows(self, req: Request, num_pages: int) -> tuple[int, list[list[int]]]:
        """Cut match()'s `num_pages` hit back to the longest one every window group can serve: its cached pages
        from the first one the hit's end may read (WindowGroup.first_live_page) to the end. Returns the hit's pages
        and, per window group, its table of them (NULL_PAGE before the window); nothing is taken."""
        if not self.groups:
            return num_pages, []
        hashes = req.page_hashes[:num_pages]
        found = [[group.pool.cached_block(h) for h in hashes] for group in self.groups]
        # last_missing[g][k]: the last page before k the group lacks (-1: none), so a hit of k pages is served
        # when it lies before the group's first live page
        last_missing = []
        for pages in found:
            last, marks = -1, [-1]
            for j, block_id in enumerate(pages):
                last = j if block_id is None else last
                marks.append(last)
            last_missing.append(marks)
        for k in range(num_pages, 0, -1):
            firsts = [group.first_live_page(k * self.page_size) for group in self.groups]
            if all(marks[k] < first for marks, first in zip(last_missing, firsts)):
                return k, [[NULL_PAGE] * first + pages[first:k] for pages, first in zip(found, firsts)]
        return 0, [[] for _ in self.groups]

    def match_host(self, req: Request, num_gpu_pages: int) -> list[int | None]:
        """Host records that continue a waiting request's `num_gpu_pages` matched GPU pages (after match();
        nothing is taken), within the same cap of (num_tokens - 1) // page_size pages in all: a DRAM slot, or
        None for a disk record (restore() loads it into a slot)."""
        if self.host is None or req.wants_prompt_logprobs:
            return []
        num_pages = (req.num_tokens - 1) // self.page_size
        return self.host.find_tiered_prefix(req.page_hashes[num_gpu_pages:num_pages])

    def restore(self, req: Request, num_gpu_pages: int, slots: list[int | None]) -> list[tuple[int, int]]:
        """The admitted request copies `slots` (match_host's records) into its fresh pages after its
        `num_gpu_pages` GPU hits: returns the plan's (slot, page) copy-ins. The pages are published at once (they
        will hold full pages before any forward of this plan reads them); the slots are pinned for this plan."""
        assert self.host is not None
        first, end = num_gpu_pages, num_gpu_pages + len(slots)
        pages = req.block_ids[first:end]
        self._cache_pages(req, first, end)
        taken = self.host.take(req.page_hashes[first:end], len(slots) * self.page_size, slots)
        return list(zip(taken, pages))

    def store_evictions(self) -> list[tuple[int, int]]:
        """The plan's (page, slot) copy-outs: every page the pool evicted while this plan was built whose hash
        the host tier does not hold yet (those it holds are touched). Ends the plan's pins."""
        if self.host is None:
            return []
        copy_out = []
        for block_id, block_hash in self.pool.take_evictions():
            slot = self.host.store(block_hash)
            if slot is not None:
                copy_out.append((block_id, slot))
        self.host.end_step()
        return copy_out

    def take_disk_ops(self) -> tuple[list[tuple[int, bytes]], list[bytes], list[tuple[bytes, int]]]:
        """The plan's (spill, disk_drop, load) of the host tier's disk records (empty without one)."""
        return self.host.take_disk_ops() if self.host is not None else ([], [], [])

    def forget_copies(self, copy_out: list[tuple[int, int]], copy_in: list[tuple[int, int]],
                      spill: list[tuple[int, bytes]] = (), disk_drop: list[bytes] = (),
                      load: list[tuple[bytes, int]] = (), is_io_error: bool = False) -> None:
        """A plan failed: its copies may never have run, so the records it stored and the pages it restored
        are dropped (they would name KV that is not there); so are its disk records (HostCache.forget_disk_ops)."""
        if self.host is None:
            return
        self.host.forget_disk_ops(spill, disk_drop, load, is_io_error)
        for _, slot in copy_out:
            self.host.discard_slot(slot)
        for _, block_id in copy_in:
            self.pool.uncache_block(block_id)

    def publish(self, req: Request) -> None:
        """Cache every page of a running request now fully covered by its computed tokens (after a step)."""
        num_full = req.num_computed_tokens // self.page_size
        if num_full <= req.num_published_pages:
            return
        extend_page_hashes(req.page_hashes, req.all_token_ids, self.page_size, num_full)
        self._cache_pages(req, req.num_published_pages, num_full)
        for group, table in zip(self.groups, req.group_block_ids):
            for i in range(req.num_published_pages, num_full):
                if table[i] != NULL_PAGE:  # released before it was published (a step the runner did not report)
                    group.pool.cache_block(table[i], req.page_hashes[i])
        req.num_published_pages = num_full

    def _cache_pages(self, req: Request, first: int, end: int) -> None:
        """Cache the request's pages first..end-1 (their hashes computed) in group 0; with events on, log those
        newly cached."""
        if self.events is None:
            for i in range(first, end):
                self.pool.cache_block(req.block_ids[i], req.page_hashes[i])
            return
        stored = [i for i in range(first, end) if self.pool.cache_block(req.block_ids[i], req.page_hashes[i])]
        if stored:
            self.events.stored(req.page_hashes, req.all_token_ids, stored)
