"""The paged KV block pool: fixed-size pages, a free list and reference counts.

Owns page ids only (the runner owns the tensors they index). Reference counts let prefix-cache pages be
shared by several requests later; a page returns to the free list when its count reaches zero.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


class BlockPool:
    """`num_blocks` pages of `block_size` tokens; ids are 0 .. num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockPool needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._ref_counts = [0] * num_blocks
        # NOTE: allocate from the front, free to the back, so the least recently freed page is reused
        # first; a later prefix cache keeps freed-but-cached pages findable for as long as possible.
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def num_blocks_for(self, num_tokens: int) -> int:
        """Pages needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free pages, each with reference count 1."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > len(self._free):
            raise MemoryError(f"need {num_blocks} KV pages, {len(self._free)} free")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def incref(self, block_ids: Iterable[int]) -> None:
        """Share already-used pages (prefix cache): each holder calls `free` once when done."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"incref of free block {block_id}")
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each page; pages whose count reaches zero go back to the free list."""
        for block_id in block_ids:
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_invariants(self) -> None:
        """Assert internal consistency (tests and debugging): O(num_blocks)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has reference count {count}"
            assert (count == 0) == (block_id in free), f"block {block_id}: count {count}, free {block_id in free}"
        assert self.num_free_blocks + self.num_used_blocks == self.num_blocks
