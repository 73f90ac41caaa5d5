"""Sliding-window page groups: the KV pages of a model's sliding-window layers, kept apart from its full layers'.

vLLM's hybrid allocator, simplified. Group 0 (the full-attention layers) is the scheduler's BlockPool and
Request.block_ids as before; a window group (the layers of one window W: SchedulerConfig.sliding_window and
window_pages) has its own BlockPool (its own page ids, its own KV tensors in the runner) and its own block table per
request (Request.group_block_ids). A group's table is indexed like group 0's (entry j holds positions jP .. jP+P-1, so
every table of a request has the same length and the kernels index it unchanged); the pages wholly before the
window of the request's next query go back to the group's pool and their entries read NULL_PAGE.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

from helios.engine.block_pool import BlockPool

# NOTE: a table entry whose page went back to the pool. No query reads it: a query at position p reads the keys
# p - W < k <= p, and a page is released only once every key of it is at or before num_computed_tokens - W, where
# num_computed_tokens is the position of the request's next query (the runner turns the entry into page 0).
NULL_PAGE = -1


def window_pages_per_request(window: int, page_size: int, max_chunk: int) -> int:
    """The most pages of a window group one request holds inside a step: a chunk of up to max_chunk tokens at
    position n reads and writes positions n - W + 1 .. n + max_chunk - 1, a decode (max_chunk 1) also holds the
    look-ahead page of n + 1: at most W + max_chunk positions, which span at most ceil(that / P) + 1 pages."""
    return -(-(window + max_chunk) // page_size) + 1


class WindowGroup:
    """One window group: its pool, and the release rule of its requests' tables."""

    def __init__(self, sliding_window: int, num_pages: int, page_size: int) -> None:
        self.sliding_window = sliding_window
        self.pool = BlockPool(num_pages, page_size)

    def first_live_page(self, num_computed: int) -> int:
        """The first page a query at position num_computed (or any later one) may read: the page of key
        num_computed - W + 1 (HF's convention: a query sees itself and the W - 1 keys before it)."""
        return max(0, num_computed - self.sliding_window + 1) // self.pool.block_size

    def release_before_window(self, table: list[int], num_computed: int) -> None:
        """Return the table's pages wholly before the window of its next query (at position num_computed)."""
        end = min(self.first_live_page(num_computed), len(table))
        # released entries form a prefix: walk back from its end to the last one released before
        j = end - 1
        while j >= 0 and table[j] != NULL_PAGE:
            j -= 1
        released = table[j + 1 : end]
        if released:
            table[j + 1 : end] = [NULL_PAGE] * len(released)
            self.pool.free(released)  # oldest first: the least recently used end of the free list

    def release(self, table: list[int]) -> None:
        """Return every page of a finished, aborted or preempted request's table."""
        self.pool.free(reversed([b for b in table if b != NULL_PAGE]))  # tail first, as group 0 frees

    def num_held(self, table: list[int]) -> int:
        return sum(1 for b in table if b != NULL_PAGE)
