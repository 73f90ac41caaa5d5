"""Shared inputs for the kernel tests (CPU interpreter and tests/gpu): paged caches with scattered pages.

Pure torch; any device and dtype. Block tables are a random permutation of the pool, so a sequence's
pages are never contiguous, and rows are padded with 0 past their end like the runner pads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedCase:
    q: torch.Tensor  # [T, Nq, D]
    k: torch.Tensor  # [T, Nkv, D] this step's keys (already written into kv_cache)
    v: torch.Tensor  # [T, Nkv, D]
    kv_cache: torch.Tensor  # [2, num_pages, page_size, Nkv, D]
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    max_query_len: int


def paged_case(
    query_lens: list[int],
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    spare_pages: int = 3,
) -> PagedCase:
    """Sequence i has seq_lens[i] keys; its last query_lens[i] tokens are this step's queries."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = sum(blocks_per_seq) + spare_pages
    perm = torch.randperm(num_pages, generator=g).tolist()
    max_blocks = max(blocks_per_seq) + 1  # one padded column at least
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    # old cache contents random everywhere (unused slots included: masked lanes must ignore them)
    kv_cache = torch.randn(2, num_pages, page_size, num_kv_heads, head_dim, generator=g)
    total = sum(query_lens)
    q = torch.randn(total, num_kv_heads * group, head_dim, generator=g)
    k = torch.randn(total, num_kv_heads, head_dim, generator=g)
    v = torch.randn(total, num_kv_heads, head_dim, generator=g)
    slots = []
    for i, (n_q, n) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(n - n_q, n):
            slots.append(int(block_tables[i, pos // page_size]) * page_size + pos % page_size)
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    flat = kv_cache.view(2, -1, num_kv_heads, head_dim)
    flat[0, slot_mapping] = k
    flat[1, slot_mapping] = v
    qsl = [0]
    for n_q in query_lens:
        qsl.append(qsl[-1] + n_q)
    return PagedCase(
        q=q.to(device, dtype),
        k=k.to(device, dtype),
        v=v.to(device, dtype),
        kv_cache=kv_cache.to(device, dtype),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=slot_mapping.to(device),
        max_query_len=max(query_lens),
    )


def tolerance(dtype: torch.dtype) -> dict:
    return {
        torch.float32: dict(atol=2e-5, rtol=2e-5),
        torch.float16: dict(atol=2e-3, rtol=2e-3),
        torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
    }[dtype]
