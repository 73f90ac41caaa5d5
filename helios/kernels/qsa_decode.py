"""QSA decode (qwen4_exp, helios.layers.qsa): the indexer's block scores over the paged raw index keys, the top
blocks and the tail, and the attention over them, for one query token per sequence with every length and page read
on the device (no host sync, no data-dependent shape: CUDA-graph safe).

As helios.kernels.sparse_decode does for minimax_m3 and dsa_decode for glm5_next: the cost that grows with the
context, reading every index key, is a Triton kernel that stops at each sequence's complete blocks; it pools, norms
and turns each block's key where it reads it, so no [B, max blocks, Di] block keys reach memory. The choice has
dsa_decode.select_pools' values on the [B, max blocks] float32 scores (its stable sort: ties, relu's common zeros, to
the earlier block, as Indexer.select; the incomplete tail block listed last) from one launch (select_blocks;
minimax_m3's top_blocks too), and the attention is sparse_decode.sparse_decode with one index head: every query head
reads the same block list, each block clamped to the length. The step's K/V and index keys go into their slots in
one launch (write_caches, minimax_m3's too). Imports torch and helios.kernels only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    require_triton,
    round_to,
    tl,
)
from helios.kernels.dsa_decode import select_pools
from helios.kernels.sparse_decode import sparse_decode, sparse_num_splits
from helios.kernels.sparse_decode import top_blocks as sparse_top_blocks


@jit
def _write_caches_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, head_dim]
    index_ptr,  # [num_tokens, Di] this step's index keys
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    index_cache_ptr,  # [num_pages, page_size, Di]
    slot_mapping_ptr,  # [num_tokens] int64, -1: a padded row, nothing written
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_it,
    stride_cp,  # K/V cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    stride_ip,  # index cache strides: page, slot in page
    stride_is,
    num_kv_heads,
    head_dim,
    index_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DI: tl.constexpr,
):
    """Program per token: reshape_and_cache's K/V rows and write_latent's index key row, into the same slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    tile_slot = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot  # as a tile: a scalar mask trips the interpreter
    mask = (heads < num_kv_heads) & (d < head_dim) & (tile_slot >= 0)
    dst = (tile_slot // PAGE_SIZE) * stride_cp + (tile_slot % PAGE_SIZE) * stride_cs + heads * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + d, mask=mask, other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
    di = tl.arange(0, BLOCK_DI)
    row_slot = tl.zeros([BLOCK_DI], dtype=tl.int64) + slot
    row_mask = (di < index_dim) & (row_slot >= 0)
    key = tl.load(index_ptr + t * stride_it + di, mask=row_mask, other=0.0)
    dst_i = (row_slot // PAGE_SIZE) * stride_ip + (row_slot % PAGE_SIZE) * stride_is + di
    tl.store(index_cache_ptr + dst_i, key.to(index_cache_ptr.dtype.element_ty), mask=row_mask)


def write_caches(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (rows may be strided)
    v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    index_k: torch.Tensor,  # [num_tokens, Di] (rows may be strided)
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim], written in place
    index_cache: torch.Tensor,  # [1, num_pages, page_size, Di], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """reshape_and_cache(k, v) and write_latent(index_k) in one launch: an indexed layer's decode-step writes (QSA's
    raw index keys, minimax_m3's normed and turned ones), each in its cache's dtype; padded rows write nothing."""
    require_triton()
    num_tokens, num_kv_heads, head_dim = k.shape
    index_dim = index_k.shape[1]
    assert v.shape == k.shape, f"v {tuple(v.shape)} != k {tuple(k.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim)
    assert index_cache.dim() == 4 and index_cache.shape[0] == 1 and index_cache.shape[3] == index_dim
    assert index_cache.shape[1:3] == kv_cache.shape[1:3], "the index keys share the K/V pages' slots"
    assert index_k.shape == (num_tokens, index_dim)
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    for name, t in (("k", k), ("v", v), ("index_k", index_k), ("kv_cache", kv_cache), ("index_cache", index_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    k_cache, v_cache, pages = kv_cache[0], kv_cache[1], index_cache[0]
    _write_caches_kernel[(num_tokens,)](
        k, v, index_k, k_cache, v_cache, pages, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        index_k.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), pages.stride(0), pages.stride(1),
        num_kv_heads, head_dim, index_dim, PAGE_SIZE=kv_cache.shape[2], BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim), BLOCK_DI=next_power_of_2(index_dim), num_warps=4,
    )


@jit
def _block_scores_kernel(
    q_ptr,  # [num_seqs, num_index_heads, Di], the index queries (normed and turned, or raw with NORM_Q)
    index_ptr,  # [num_pages, page_size, Di], the raw index keys
    norm_ptr,  # [Di], the indexer's k_norm weight
    q_norm_ptr,  # [Di], the indexer's q_norm weight (multiplied in float32), read only with NORM_Q
    q_cos_ptr,  # [num_seqs, rotary_dim] at each query's position (rows of stride_qc), read only with NORM_Q
    q_sin_ptr,  # [num_seqs, rotary_dim], same strides
    cos_ptr,  # [num_blocks, rotary_dim], at each block's first position
    sin_ptr,  # [num_blocks, rotary_dim]
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_blocks] float32
    stride_qs,
    stride_qh,
    stride_ip,  # index cache strides: page, slot in page
    stride_is,
    stride_cb,  # cos / sin row stride
    stride_qc,  # q_cos / q_sin row stride
    stride_bt,
    stride_os,
    num_heads,
    index_dim,
    rotary_dim,
    eps,
    q_eps,
    root,  # sqrt(Di), divided as the reference divides
    NORM_Q: tl.constexpr,  # the queries' norm and rotary here, as rms_norm_rope(round_products) makes them
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the indexer's block of keys
    BLOCK_N: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Program (seq, block): the block's key as Indexer.block_keys makes it (the float32 mean of its raw keys in
    their dtype, k_norm in float32, rotate-half rotary at its first position, each product rounded to the dtype as the
    reference's), then sum_h relu(q_h . key) / sqrt(Di) in float32; -inf unless the block is complete (block <
    seq_len // BLOCK_SIZE), stored without reading a key. Rotate-half pairs dim d with d +- rotary_dim / 2: the
    program reads the keys at both columns."""
    seq = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    if blk >= seq_len // BLOCK_SIZE:  # incomplete, past the end or a padded row: most of a graph bucket's width
        tl.store(out_ptr + seq * stride_os + blk, float("-inf"))
        return
    d = tl.arange(0, BLOCK_D)
    d_mask = d < index_dim
    half = rotary_dim // 2
    turned = d < rotary_dim
    partner = tl.where(turned, tl.where(d < half, d + half, d - half), d)
    n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    total = tl.zeros([BLOCK_D], dtype=tl.float32)
    total_p = tl.zeros([BLOCK_D], dtype=tl.float32)  # the same sums at the partner columns
    for n0 in range(0, BLOCK_SIZE, BLOCK_N):
        pos = blk * BLOCK_SIZE + n0 + n
        row_mask = n0 + n < BLOCK_SIZE
        page = tl.load(table + pos // PAGE_SIZE, mask=row_mask, other=0).to(tl.int64)
        rows = index_ptr + page * stride_ip + (pos % PAGE_SIZE) * stride_is
        tile = row_mask[:, None] & d_mask[None, :]
        keys = tl.load(rows[:, None] + d[None, :], mask=tile, other=0.0)
        total += tl.sum(keys.to(tl.float32), axis=0)
        total_p += tl.sum(tl.load(rows[:, None] + partner[None, :], mask=tile, other=0.0).to(tl.float32), axis=0)
    dt = index_ptr.dtype.element_ty
    mean = (total / BLOCK_SIZE).to(dt).to(tl.float32)
    mean_p = (total_p / BLOCK_SIZE).to(dt).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(mean * mean, axis=0) / index_dim + eps)
    w = tl.load(norm_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    w_p = tl.load(norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)
    normed = (mean * inv * w).to(dt).to(tl.float32)
    normed_p = (mean_p * inv * w_p).to(dt).to(tl.float32)
    r_mask = turned & d_mask
    cos = tl.load(cos_ptr + blk * stride_cb + d, mask=r_mask, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + blk * stride_cb + d, mask=r_mask, other=0.0).to(tl.float32)
    rotated = tl.where(d < half, -normed_p, normed_p)
    key = ((normed * cos).to(dt).to(tl.float32) + (rotated * sin).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    key = tl.where(turned, key, normed)
    heads = tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    q_tile = h_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q = tl.load(q_rows + d[None, :], mask=q_tile, other=0.0).to(tl.float32)
    if NORM_Q:  # each program norms and turns the few query heads itself: no launch of their own before it
        q_p = tl.load(q_rows + partner[None, :], mask=q_tile, other=0.0).to(tl.float32)
        q_inv = tl.rsqrt(tl.sum(q * q, axis=1) / index_dim + q_eps)[:, None]
        wq = tl.load(q_norm_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        wq_p = tl.load(q_norm_ptr + partner, mask=d_mask, other=0.0).to(tl.float32)[None, :]
        qdt = q_ptr.dtype.element_ty
        lower = (d < half)[None, :]
        qn = round_to(q * q_inv * wq, qdt)
        qn_p = round_to(q_p * q_inv * wq_p, qdt)
        q_cos = tl.load(q_cos_ptr + seq * stride_qc + d, mask=r_mask, other=1.0).to(tl.float32)[None, :]
        q_sin = tl.load(q_sin_ptr + seq * stride_qc + d, mask=r_mask, other=0.0).to(tl.float32)[None, :]
        # -x2 * sin rounds as -(x2 * sin): apply_rotary's products, then their sum, each rounded
        q_turned = round_to(round_to(qn * q_cos, qdt) + round_to(tl.where(lower, -qn_p, qn_p) * q_sin, qdt), qdt)
        q = tl.where(turned[None, :], q_turned, qn)
    s = tl.maximum(tl.sum(q * key[None, :], axis=1), 0.0)  # [BLOCK_H], relu; masked heads 0
    tl.store(out_ptr + seq * stride_os + blk, tl.sum(s, axis=0) / root)


def block_scores(
    q: torch.Tensor,  # [num_seqs, num_index_heads, Di]
    index_cache: torch.Tensor,  # [1, num_pages, page_size, Di], raw index keys
    norm_weight: torch.Tensor,  # [Di], Indexer.k_norm's
    eps: float,
    cos: torch.Tensor,  # [num_blocks, rotary_dim] at positions 0, block_size, 2 * block_size, ... (block_starts)
    sin: torch.Tensor,  # [num_blocks, rotary_dim], same strides as cos
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence including this token's
    block_size: int,
    *,
    q_norm_weight: torch.Tensor | None = None,  # [Di], Indexer.q_norm's: q is raw, normed and turned here
    q_eps: float = 0.0,
    q_cos: torch.Tensor | None = None,  # [num_seqs, rotary_dim] at each query's position (with q_norm_weight)
    q_sin: torch.Tensor | None = None,  # [num_seqs, rotary_dim], same strides as q_cos
) -> torch.Tensor:  # [num_seqs, num_blocks] float32, -inf past the complete blocks
    """Every complete block's score; the block count comes from the table's width, never from the lengths (a
    graph's shapes are its bucket's). With q_norm_weight the raw queries' norm (multiplied in float32) and rotary
    happen in every program, with rms_norm_rope(round_products)'s roundings: their launch folded in."""
    require_triton()
    num_seqs, num_heads, index_dim = q.shape
    page_size = index_cache.shape[2]
    num_blocks = block_count(block_tables.shape[1], page_size, block_size)
    rotary_dim = cos.shape[-1]
    assert index_cache.dim() == 4 and index_cache.shape[0] == 1 and index_cache.shape[3] == index_dim
    assert norm_weight.shape == (index_dim,) and norm_weight.is_contiguous()
    assert cos.shape == sin.shape == (num_blocks, rotary_dim) and cos.stride() == sin.stride()
    assert rotary_dim % 2 == 0 and rotary_dim <= index_dim and cos.stride(1) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("index_cache", index_cache)
    norm_q = q_norm_weight is not None
    if norm_q:
        assert q_norm_weight.shape == (index_dim,) and q_norm_weight.is_contiguous()
        assert q_cos.shape == q_sin.shape == (num_seqs, rotary_dim) and q_cos.stride() == q_sin.stride()
        assert q_cos.stride(1) == 1
    out = torch.empty(num_seqs, num_blocks, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or num_blocks == 0:
        return out
    pages = index_cache[0]
    _block_scores_kernel[(num_seqs, num_blocks)](
        q, pages, norm_weight, q_norm_weight if norm_q else norm_weight, q_cos if norm_q else cos,
        q_sin if norm_q else sin, cos, sin, block_tables, seq_lens, out, q.stride(0), q.stride(1), pages.stride(0),
        pages.stride(1), cos.stride(0), q_cos.stride(0) if norm_q else 0, block_tables.stride(0), out.stride(0),
        num_heads, index_dim, rotary_dim, eps, q_eps, index_dim**0.5, NORM_Q=norm_q, PAGE_SIZE=page_size,
        BLOCK_SIZE=block_size,
        BLOCK_N=max(16, min(64, next_power_of_2(block_size))), BLOCK_H=max(16, next_power_of_2(num_heads)),
        BLOCK_D=max(16, next_power_of_2(index_dim)), num_warps=4,
    )
    return out


def block_count(max_pages: int, page_size: int, block_size: int) -> int:
    """Complete blocks a table of max_pages pages can hold: the static score width of a step."""
    return max_pages * page_size // block_size


@jit
def _select_blocks_kernel(
    scores_ptr,  # [num_rows, num_blocks] float32, row stride stride_s
    seq_lens_ptr,  # [num_seqs] int32, read only with MASK_PAST (row r is sequence r // rows_per_seq)
    out_ptr,  # [num_rows, num_kept (+ 1 with MASK_PAST)], row stride stride_o
    stride_s,
    stride_o,
    num_blocks,
    num_kept,
    rows_per_seq,
    block_size,
    MASK_PAST: tl.constexpr,  # -1 for blocks past the complete ones, then the tail block
    BLOCK_I: tl.constexpr,
    BLOCK_J: tl.constexpr,
):
    """Program (row, chunk of BLOCK_I blocks): each block's place in a stable descending sort, counted (the blocks
    scoring more, and the earlier ones scoring the same: -0.0 ties +0.0 as comparisons see it); a block placed
    before num_kept is written there. Every place is one block's, so the programs' writes never meet, and no
    program waits on another (a sort or top-k one pick at a time would)."""
    row = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = i < num_blocks
    scores_row = scores_ptr + row * stride_s
    mine = tl.load(scores_row + i, mask=i_mask, other=float("-inf"))
    place = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(0, num_blocks, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        theirs = tl.load(scores_row + j, mask=j < num_blocks, other=float("-inf"))
        before = (theirs[None, :] > mine[:, None]) | ((theirs[None, :] == mine[:, None]) & (j[None, :] < i[:, None]))
        place += tl.sum((before & (j < num_blocks)[None, :]).to(tl.int32), axis=1)
    out_row = out_ptr + row * stride_o
    kept = i_mask & (place < num_kept)
    pick = i
    if MASK_PAST:
        seq_len = tl.load(seq_lens_ptr + row // rows_per_seq)
        complete = seq_len // block_size
        pick = tl.where(i < complete, i, -1)
        if tl.program_id(1) == 0:  # the tail: its incomplete block, -1 for a padded row
            tl.store(out_row + num_kept, tl.where(seq_len > 0, complete, -1).to(out_ptr.dtype.element_ty))
    tl.store(out_row + place, pick.to(out_ptr.dtype.element_ty), mask=kept)


SELECT_MAX_BLOCKS = 1 << 16  # a row's places counted by comparing every pair: wider tables sort in torch


def select_blocks(scores: torch.Tensor, seq_lens: torch.Tensor, block_size: int, num_kept: int) -> torch.Tensor:
    """[num_seqs, min(num_kept, num_blocks) + 1] int32: the best num_kept complete blocks (ties to the earlier
    block), -1 past the sequence's complete blocks, then the tail block (seq_len // block_size, maybe empty; -1 for a
    padded row): dsa_decode.select_pools' values, whose pools are QSA's blocks, in one launch (select_pools: ten)."""
    num_seqs, num_blocks = scores.shape
    if num_blocks > SELECT_MAX_BLOCKS:
        return select_pools(scores, seq_lens, block_size, num_kept)
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    kept = min(num_kept, num_blocks)
    out = torch.empty(num_seqs, kept + 1, dtype=torch.int32, device=scores.device)
    return _select(scores, seq_lens, out, block_size, kept, 1, True)


def top_blocks(
    scores: torch.Tensor,  # [num_seqs, num_index_heads, num_blocks] float32, sparse_decode.block_scores'
    num_kept: int,
) -> torch.Tensor:  # [num_seqs, num_index_heads, min(num_kept, num_blocks)] int64
    """sparse_decode.top_blocks' indices (its stable descending sort, cut at num_kept) in one launch: minimax_m3's
    choice, whose past-the-end blocks score -inf and stay listed."""
    num_seqs, num_heads, num_blocks = scores.shape
    if num_blocks > SELECT_MAX_BLOCKS:
        return sparse_top_blocks(scores, num_kept)
    kept = min(num_kept, num_blocks)
    out = torch.empty(num_seqs, num_heads, kept, dtype=torch.int64, device=scores.device)
    _select(scores.reshape(num_seqs * num_heads, num_blocks), scores, out.view(num_seqs * num_heads, kept), 1, kept,
            num_heads, False)
    return out


def _select(scores, seq_lens, out, block_size, kept, rows_per_seq, mask_past) -> torch.Tensor:
    require_triton()
    num_rows, num_blocks = scores.shape
    assert scores.dtype == torch.float32 and num_blocks <= SELECT_MAX_BLOCKS, (scores.dtype, num_blocks)
    check_last_dim_contiguous("scores", scores)
    if num_rows == 0:
        return out
    block_i = min(64, max(16, next_power_of_2(num_blocks)))
    _select_blocks_kernel[(num_rows, cdiv(max(num_blocks, 1), block_i))](
        scores, seq_lens, out, scores.stride(0), out.stride(0), num_blocks, kept, rows_per_seq, block_size,
        MASK_PAST=mask_past, BLOCK_I=block_i, BLOCK_J=128, num_warps=4,
    )
    return out


def qsa_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    blocks: torch.Tensor,  # [num_seqs, K + 1] int32, select_blocks'
    block_size: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] in the cache's dtype
    """Every query head over the listed blocks' keys j < seq_len (sparse_decode with one index head); the split count
    from the config alone (sparse_num_splits), so eager and graphed steps round alike."""
    splits = sparse_num_splits(blocks.shape[1], block_size)
    return sparse_decode(q, kv_cache, block_tables, seq_lens, blocks[:, None, :], block_size, scale, splits)
