"""BlockPool: allocation, free list order, reference counts and misuse."""

from __future__ import annotations

import pytest

from helios.engine.block_pool import BlockPool


def test_allocate_and_free_round_trip():
    pool = BlockPool(8, 16)
    assert pool.num_free_blocks == 8 and pool.num_used_blocks == 0
    assert pool.can_allocate(8) and not pool.can_allocate(9)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a) | set(b)) == 8 and pool.num_free_blocks == 0
    assert all(pool.ref_count(x) == 1 for x in a + b)
    assert pool.allocate(0) == []
    with pytest.raises(MemoryError):
        pool.allocate(1)
    pool.free(a)
    assert pool.num_free_blocks == 3
    pool.check_invariants()
    pool.free(b)
    assert pool.num_free_blocks == 8
    pool.check_invariants()


def test_reuses_the_least_recently_freed_page_first():
    pool = BlockPool(4, 4)
    first = pool.allocate(4)
    pool.free([first[2]])
    pool.free([first[0]])
    assert pool.allocate(2) == [first[2], first[0]]


def test_shared_pages_return_when_the_last_holder_frees():
    pool = BlockPool(4, 4)
    shared = pool.allocate(2)
    pool.incref(shared)
    assert [pool.ref_count(x) for x in shared] == [2, 2]
    pool.free(shared)
    assert pool.num_free_blocks == 2
    pool.free(shared)
    assert pool.num_free_blocks == 4
    pool.check_invariants()


def test_misuse_raises():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free(blocks)
    with pytest.raises(ValueError, match="incref of free"):
        pool.incref(blocks)
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError):
        BlockPool(0, 4)
    pool.check_invariants()


def test_num_blocks_for():
    pool = BlockPool(4, 16)
    assert [pool.num_blocks_for(n) for n in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]
