"""DSA decode (glm5_next, helios.layers.dsa): the pooled indexer's scores over the paged index rows, the top pools,
and the absorbed MLA attention over the chosen pools and the tail, for one query token per sequence with every length
and page read on the device (no host sync, no data-dependent shape: CUDA-graph safe).

As helios.kernels.sparse_decode does for minimax_m3: the two costs that grow with the context (every index row for
the pool keys and scores; the chosen pools' latent rows) are Triton kernels that stop at each sequence's length, and
the choice between the [B, max pools] float32 scores is the reference's own stable torch sort (ties to the earlier
pool by construction; helios.kernels.qsa_decode.select_blocks gives the same lists in one launch). The attention
reads a list of pools per sequence: the chosen ones (-1: none) and last the incomplete tail pool, each clamped to the
length, so "every key" (a sequence with num_pools pools or fewer) and "chosen pools + tail" are one launch. A batch-1
step counts launches, so the torch tails fold in: pool_scores scales the raw head weights and (IndexWrite) computes
and writes the decode token's index row (write_index_rows' LayerNorm and write), and sparse_mla_decode_absorbed is
mla_decode_absorbed's three launches around this attention (the latent write and its norm in the first). Imports
torch and helios.kernels only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from helios.kernels._triton import cdiv, check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.mla_decode import LatentWrite, absorb_query, merge_expand
from helios.kernels.paged_attention import dot_precision, merge_splits, split_partials
from helios.kernels.sparse_decode import online_softmax_tile, store_decode_output


@jit
def _write_index_rows_kernel(
    proj_ptr,  # [num_tokens, >= 2*Di] the indexer's in_proj rows: the raw key, then the pool-gate logits
    norm_w_ptr,  # [Di] k_norm.weight
    norm_b_ptr,  # [Di] k_norm.bias
    cache_ptr,  # [num_pages, page_size, 2*Di]
    slot_mapping_ptr,  # [num_tokens] int64, -1: a padded row, nothing written
    stride_pt,
    stride_cp,  # cache strides: page, slot in page
    stride_cs,
    index_dim,
    eps,
    PAGE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # >= Di
):
    """Program per token: its index row into its slot."""
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    key, gate = _index_row(proj_ptr + t * stride_pt, norm_w_ptr, norm_b_ptr, d, index_dim, eps)
    dtype = cache_ptr.dtype.element_ty
    _store_index_row(key.to(dtype), gate.to(dtype), cache_ptr, slot_mapping_ptr + t, d, stride_cp, stride_cs,
                     index_dim, PAGE_SIZE, BLOCK_D)


@jit
def _index_row(row_ptr, norm_w_ptr, norm_b_ptr, d, index_dim, eps):
    """A token's index row from its in_proj row, in that row's dtype (the caller casts to the cache's): F.layer_norm
    of the key (float32 statistics, rounded to the key's dtype as the op stores it), and the gate logits as they are."""
    d_mask = d < index_dim
    key = tl.load(row_ptr + d, mask=d_mask, other=0.0)
    x = key.to(tl.float32)
    mean = tl.sum(x, axis=0) / index_dim
    centred = tl.where(d_mask, x - mean, 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, axis=0) / index_dim + eps)
    w = tl.load(norm_w_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    b = tl.load(norm_b_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    normed = (centred * rstd * w + b).to(key.dtype)
    return normed, tl.load(row_ptr + index_dim + d, mask=d_mask, other=0.0)


@jit
def _store_index_row(key, gate, cache_ptr, slot_ptr, d, stride_cp, stride_cs, index_dim, PAGE_SIZE: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """[key, gate] into the slot at slot_ptr (nothing for slot -1)."""
    slot = tl.zeros([BLOCK_D], dtype=tl.int64) + tl.load(slot_ptr)  # a tile: a scalar mask trips the interpreter
    live = (d < index_dim) & (slot >= 0)
    dst = cache_ptr + (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + d
    tl.store(dst, key, mask=live)
    tl.store(dst + index_dim, gate, mask=live)


class IndexWrite(NamedTuple):
    """write_index_rows' arguments after the cache: this step's index rows, one per sequence (pool_scores' write)."""

    proj: torch.Tensor  # [num_tokens, 2*Di + Ni] the indexer's raw in_proj output (rows may be strided)
    norm_weight: torch.Tensor  # [Di]
    norm_bias: torch.Tensor  # [Di]
    eps: float
    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = skip


def write_index_rows(
    index_cache: torch.Tensor,  # [1, num_pages, page_size, 2*Di], written in place
    proj: torch.Tensor,  # [num_tokens, 2*Di + Ni] the indexer's raw in_proj output (rows may be strided)
    norm_weight: torch.Tensor,  # [Di]
    norm_bias: torch.Tensor,  # [Di]
    eps: float,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """DsaIndexer.project's cached rows (the key LayerNorm'd, then the gate logits) written into their slots in one
    launch: the layer_norm, the cat and write_latent's launch folded; padded rows write nothing."""
    require_triton()
    num_tokens, index_dim = proj.shape[0], norm_weight.shape[0]
    _check_index_write(index_cache, IndexWrite(proj, norm_weight, norm_bias, eps, slot_mapping))
    if num_tokens == 0:
        return
    pages = index_cache[0]
    _write_index_rows_kernel[(num_tokens,)](
        proj, norm_weight, norm_bias, pages, slot_mapping, proj.stride(0), pages.stride(0), pages.stride(1),
        index_dim, eps, PAGE_SIZE=index_cache.shape[2], BLOCK_D=next_power_of_2(index_dim), num_warps=4,
    )


def _check_index_write(index_cache: torch.Tensor, w: IndexWrite) -> None:
    index_dim = w.norm_weight.shape[0]
    assert index_cache.dim() == 4 and index_cache.shape[0] == 1 and index_cache.shape[3] == 2 * index_dim
    assert w.proj.dim() == 2 and w.proj.shape[1] >= 2 * index_dim and w.norm_bias.shape == (index_dim,)
    assert w.norm_weight.is_contiguous() and w.norm_bias.is_contiguous()
    assert w.slot_mapping.shape == (w.proj.shape[0],) and w.slot_mapping.dtype == torch.int64
    check_last_dim_contiguous("proj", w.proj)
    check_last_dim_contiguous("index_cache", index_cache)


def write_index_rows_ref(index_cache, proj, norm_weight, norm_bias, eps, slot_mapping) -> None:
    """write_index_rows as DsaIndexer.project and the layer's write compute it, skipping negative slots."""
    index_dim = norm_weight.shape[0]
    key = torch.nn.functional.layer_norm(proj[:, :index_dim], (index_dim,), norm_weight, norm_bias, eps)
    rows = torch.cat([key, proj[:, index_dim : 2 * index_dim]], dim=-1)
    keep = slot_mapping >= 0
    flat = index_cache.view(-1, index_cache.shape[-1])
    flat.index_copy_(0, slot_mapping[keep], rows[keep].to(index_cache.dtype))


@jit
def _pool_scores_kernel(
    q_ptr,  # [num_seqs, num_index_heads, Di], the index queries
    w_ptr,  # [num_seqs, num_index_heads], the head weights (times weight_scale in float32)
    index_ptr,  # [num_pages, page_size, 2*Di]: each token's normed index key, then its pool-gate logits
    pool_bias_ptr,  # [POOL, Di]
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, max_pools] float32
    proj_ptr,  # WRITE: [num_seqs, >= 2*Di] this step's raw in_proj rows (_write_index_rows_kernel's inputs)
    norm_w_ptr,  # WRITE: [Di] k_norm.weight
    norm_b_ptr,  # WRITE: [Di] k_norm.bias
    slot_mapping_ptr,  # WRITE: [num_seqs] int64, -1: a padded row
    stride_qs,
    stride_qh,
    stride_ws,
    stride_ip,  # index cache strides: page, slot in page
    stride_is,
    stride_bt,
    stride_os,
    stride_pt,
    num_heads,
    index_dim,
    num_pools,  # out's width (the grid has at least one program per sequence, for WRITE)
    scale,  # Di^-0.5
    weight_scale,  # the head weights' factor (Ni^-0.5 for raw ones, 1.0 for scaled float32 ones)
    eps,  # WRITE: k_norm's
    PAGE_SIZE: tl.constexpr,
    POOL: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= POOL
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    WRITE: tl.constexpr,
):
    """Program (seq, pool): the pool's key (a softmax mix of its tokens' keys per channel), then sum_h w_h *
    relu(q_h . key * scale) in float32; -inf unless the pool is complete (pool < seq_len // POOL). WRITE: the
    sequence's decode token (position seq_len - 1) has its index row computed here, from its in_proj row, as
    write_index_rows computes it: program (seq, 0) writes it into its slot, and the program of the pool it completes
    takes it from registers, never from the cache another program writes."""
    seq = tl.program_id(0).to(tl.int64)
    pool = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    j = tl.arange(0, BLOCK_P)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < index_dim
    pos = pool * POOL + j
    complete = tl.zeros([BLOCK_P], dtype=tl.int32) + pool < seq_len // POOL  # as a tile (the interpreter)
    row_mask = (j < POOL) & complete
    page = tl.load(block_tables_ptr + seq * stride_bt + pos // PAGE_SIZE, mask=row_mask, other=0).to(tl.int64)
    rows = index_ptr + page * stride_ip + (pos % PAGE_SIZE) * stride_is
    tile = row_mask[:, None] & d_mask[None, :]
    keys = tl.load(rows[:, None] + d[None, :], mask=tile, other=0.0)  # [BLOCK_P, BLOCK_D]
    gates = tl.load(rows[:, None] + index_dim + d[None, :], mask=tile, other=0.0)
    if WRITE:
        new_key, new_gate = _index_row(proj_ptr + seq * stride_pt, norm_w_ptr, norm_b_ptr, d, index_dim, eps)
        new_key = new_key.to(index_ptr.dtype.element_ty)
        new_gate = new_gate.to(index_ptr.dtype.element_ty)
        if pool == 0:
            _store_index_row(new_key, new_gate, index_ptr, slot_mapping_ptr + seq, d, stride_ip, stride_is, index_dim,
                             PAGE_SIZE, BLOCK_D)
        is_new = (pos == seq_len - 1)[:, None]
        keys = tl.where(is_new, new_key[None, :], keys)
        gates = tl.where(is_new, new_gate[None, :], gates)
    gates = gates.to(tl.float32)
    gates += tl.load(pool_bias_ptr + j[:, None] * index_dim + d[None, :], mask=(j < POOL)[:, None] & d_mask[None, :],
                     other=0.0).to(tl.float32)
    gates = tl.where(tile, gates, float("-inf"))
    top = tl.max(gates, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an incomplete pool: every lane masked, no NaN
    e = tl.exp(gates - top[None, :])
    mix = (e / tl.where(tl.sum(e, axis=0) > 0, tl.sum(e, axis=0), 1.0)[None, :]).to(keys.dtype)
    # in the keys' dtype, as the reference's (mix * keys).sum(): each product rounded, the sum rounded once
    pool_key = tl.sum((mix * keys).to(tl.float32), axis=0).to(keys.dtype).to(tl.float32)  # [BLOCK_D]
    heads = tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    s = tl.maximum(tl.sum(q * pool_key[None, :], axis=1) * scale, 0.0)  # [BLOCK_H]
    w = tl.load(w_ptr + seq * stride_ws + heads, mask=h_mask, other=0.0).to(tl.float32) * weight_scale
    score = tl.sum(w * s, axis=0)
    is_complete = pool < seq_len // POOL
    tl.store(out_ptr + seq * stride_os + pool, tl.where(is_complete, score, float("-inf")), mask=pool < num_pools)


def pool_scores(
    q: torch.Tensor,  # [num_seqs, num_index_heads, Di]
    weights: torch.Tensor,  # [num_seqs, num_index_heads] (rows may be strided)
    index_cache: torch.Tensor,  # [1, num_pages, page_size, 2*Di]
    pool_bias: torch.Tensor,  # [pool_size, Di]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    weight_scale: float = 1.0,
    write: IndexWrite | None = None,  # this step's index rows, one per sequence: written (and scored) here
) -> torch.Tensor:  # [num_seqs, max_pages * page_size // pool_size] float32, -inf past the complete pools
    """Every complete pool's score; the pool count comes from the table's width, never from the lengths (a graph's
    shapes are its bucket's). The head weights are weights.float() * weight_scale, as DsaIndexer.project scales
    them (raw in_proj columns with Ni^-0.5: that op's launches folded in). With `write`, write_index_rows' work
    runs in this launch (one launch fewer a step): the decode token's row, scored from registers where it completes a
    pool."""
    require_triton()
    num_seqs, num_heads, index_dim = q.shape
    pool_size = pool_bias.shape[0]
    assert index_cache.dim() == 4 and index_cache.shape[0] == 1 and index_cache.shape[3] == 2 * index_dim
    assert pool_bias.shape == (pool_size, index_dim) and pool_bias.is_contiguous()
    assert weights.shape == (num_seqs, num_heads) and weights.stride(1) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("index_cache", index_cache)
    page_size = index_cache.shape[2]
    num_pools = block_tables.shape[1] * page_size // pool_size
    out = torch.empty(num_seqs, num_pools, dtype=torch.float32, device=q.device)
    if write is not None:
        _check_index_write(index_cache, write)
        assert write.proj.shape[0] == num_seqs and write.norm_weight.shape == (index_dim,), "one row per sequence"
        proj, norm_w, norm_b, eps, slots = write
    else:
        proj, norm_w, norm_b, eps, slots = q, q, q, 0.0, q
    if num_seqs == 0 or (num_pools == 0 and write is None):
        return out
    pages = index_cache[0]
    _pool_scores_kernel[(num_seqs, max(num_pools, 1))](
        q, weights, pages, pool_bias, block_tables, seq_lens, out, proj, norm_w, norm_b, slots, q.stride(0),
        q.stride(1), weights.stride(0), pages.stride(0), pages.stride(1), block_tables.stride(0), out.stride(0),
        proj.stride(0), num_heads, index_dim, num_pools, index_dim**-0.5, weight_scale, eps, PAGE_SIZE=page_size,
        POOL=pool_size, BLOCK_P=max(16, next_power_of_2(pool_size)), BLOCK_H=max(16, next_power_of_2(num_heads)),
        BLOCK_D=max(16, next_power_of_2(index_dim)), WRITE=write is not None, num_warps=4,
    )
    return out


def select_pools(
    scores: torch.Tensor,  # [num_seqs, max_pools] float32, pool_scores'
    seq_lens: torch.Tensor,  # [num_seqs] int32
    pool_size: int,
    num_kept: int,  # DsaConfig.num_pools
) -> torch.Tensor:  # [num_seqs, min(num_kept, max_pools) + 1] int32: pools to attend, -1 none, the tail pool last
    """The best num_kept complete pools, ties to the earlier pool (a stable sort, as DsaIndexer.select), -1 past the
    sequence's complete pools; then its incomplete tail pool (seq_len // pool_size, clamped to the length: maybe empty),
    -1 for a padded row. Static shapes only.
    NOTE: + 0.0 turns a -0.0 score (a negative head weight times relu's 0) into +0.0: a sort that orders floats by
    their bits would put -0.0 first among zeros where the reference's comparisons see a tie."""
    nb = seq_lens.long() // pool_size  # [B] complete pools
    kept = min(num_kept, scores.shape[1])
    best = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[:, :kept]
    best = torch.where(best < nb[:, None], best, -1)
    tail = torch.where(seq_lens > 0, nb, -1)
    return torch.cat([best, tail[:, None]], dim=1).to(torch.int32)


@jit
def _sparse_mla_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, R + dr], absorbed queries
    cache_ptr,  # [num_pages, page_size, R + dr]
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    pools_ptr,  # [num_seqs, num_listed] int32, -1: none
    out_ptr,  # [num_seqs, num_heads, R], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, R] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    stride_qs,
    stride_qh,
    stride_cp,  # cache strides: page, slot in page
    stride_cs,
    stride_bt,
    stride_ps,
    stride_os,
    stride_oh,
    num_heads,
    num_listed,
    rank,
    rope_dim,
    scale,
    PAGE_SIZE: tl.constexpr,
    POOL: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, head block, split): helios.kernels.mla_decode's absorbed attention over the keys j < seq_len of
    the split's share of the listed pools (any order: the softmax does not care)."""
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    r = tl.arange(0, BLOCK_R)
    r_mask = r < rank
    q_rows = q_ptr + seq * stride_qs + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_H, BLOCK_R]
    e = tl.arange(0, BLOCK_DR)
    e_mask = e < rope_dim
    if HAS_ROPE:
        q_pe = tl.load(q_rows + rank + e[None, :], mask=h_mask[:, None] & e_mask[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below is the cheap exponential
    per_split = tl.cdiv(num_listed, NUM_SPLITS)
    c_start = split * per_split
    c_end = tl.minimum(c_start + per_split, num_listed)
    table = block_tables_ptr + seq * stride_bt
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    for c in range(c_start, c_end):
        pool = tl.load(pools_ptr + seq * stride_ps + c)
        start = pool * POOL
        # -1 (none) gives an empty range; as a tile: a scalar mask term trips the interpreter
        end = tl.zeros([BLOCK_N], dtype=tl.int32) + tl.where(pool >= 0, tl.minimum(start + POOL, seq_len), 0)
        for n0 in range(0, POOL, BLOCK_N):
            pos = start + n0 + tl.arange(0, BLOCK_N)
            k_mask = (pos < end) & (pos >= 0)
            page = tl.load(table + pos // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
            row = page * stride_cp + (pos % PAGE_SIZE) * stride_cs
            # the latent row, read once for every head of the block: key (with the rope part) and value at once
            lat = tl.load(cache_ptr + row[:, None] + r[None, :], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
            if HAS_ROPE:
                k_pe = tl.load(cache_ptr + row[:, None] + rank + e[None, :], mask=k_mask[:, None] & e_mask[None, :],
                               other=0.0)
                s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
            s = tl.where(k_mask[None, :], s * qk_scale, float("-inf"))
            m, l, acc = online_softmax_tile(s, m, l, acc, lat, DOT_PRECISION)
    store_decode_output(acc, m, l, out_ptr, part_out_ptr, part_lse_ptr, seq, heads, h_mask, r, r_mask, stride_os,
                        stride_oh, num_heads, rank, split, NUM_SPLITS)


def sparse_mla_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, R + dr], [q_nope W_uk, q_rope] per head
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    pools: torch.Tensor,  # [num_seqs, num_listed] int32, select_pools'
    pool_size: int,
    rank: int,  # R: the latent's width, the output's
    scale: float,
    num_splits: int = 1,
    block_h: int = 16,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, R] in q's dtype
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,  # split_partials(out, num_splits): left unmerged
) -> torch.Tensor:  # [num_seqs, num_heads, R], the attention-weighted latents (in q's dtype)
    """mla_decode over the listed pools' keys only; float32 softmax and accumulation. num_splits (along the list) is a
    launch constant, so a captured graph stays valid. Given `partials`, the splits stay there for the caller's merge
    (sparse_mla_decode_absorbed's) and `out` is written only with one split."""
    require_triton()
    num_seqs, num_heads, width = q.shape
    assert cache.dim() == 4 and cache.shape[0] == 1 and cache.shape[3] == width and 0 < rank <= width
    assert q.dtype == cache.dtype, f"q {q.dtype} and cache {cache.dtype} must share a dtype"
    assert pools.dim() == 2 and pools.shape[0] == num_seqs and pools.dtype == torch.int32 and pools.stride(1) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32 and num_splits >= 1 and block_h >= 16
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("cache", cache)
    out = q.new_empty(num_seqs, num_heads, rank) if out is None else out
    assert out.shape == (num_seqs, num_heads, rank) and out.stride(-1) == 1 and out.dtype == q.dtype
    if num_seqs == 0:
        return out
    pages = cache[0]
    rope_dim = width - rank
    block_r = max(16, next_power_of_2(rank))
    part_out, part_lse = partials or split_partials(out, num_splits)
    _sparse_mla_decode_kernel[(num_seqs, cdiv(num_heads, block_h), num_splits)](
        q, pages, block_tables, seq_lens, pools, out, part_out, part_lse,
        q.stride(0), q.stride(1), pages.stride(0), pages.stride(1), block_tables.stride(0), pools.stride(0),
        out.stride(0), out.stride(1), num_heads, pools.shape[1], rank, rope_dim, scale,
        PAGE_SIZE=cache.shape[2], POOL=pool_size, NUM_SPLITS=num_splits, HAS_ROPE=rope_dim > 0, BLOCK_H=block_h,
        BLOCK_N=max(16, min(32 if block_r <= 256 else 16, next_power_of_2(pool_size))), BLOCK_R=block_r,
        BLOCK_DR=max(16, next_power_of_2(rope_dim)), DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_r <= 256 else 8, num_stages=2,
    )
    if partials is None:
        merge_splits(part_out, part_lse, out, num_splits, False)
    return out


def sparse_mla_decode_absorbed(
    q: torch.Tensor,  # [num_seqs, num_heads, dn + dr], one query token per sequence
    kv_b: torch.Tensor,  # [num_heads * (dn + dv), R]: per head dn W_uk rows, then dv W_uv rows
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    pools: torch.Tensor,  # [num_seqs, num_listed] int32, select_pools'
    pool_size: int,
    v_dim: int,
    scale: float,
    num_splits: int = 1,
    write: LatentWrite | None = None,  # this step's latent rows, one per sequence: written by the first launch
) -> torch.Tensor:  # [num_seqs, num_heads, dv] in q's dtype
    """helios.layers.mla's absorb_query, sparse_mla_decode and expand_output in three launches, as
    mla_decode.mla_decode_absorbed around its dense attention: the absorbed query in the cache's dtype (with `write`
    also the cache write), the attention over the listed pools, then the split merge and W_uv per (seq, head)."""
    num_seqs, num_heads, _ = q.shape
    rank = kv_b.shape[1]
    q_abs = absorb_query(q, kv_b, rank, v_dim, cache.dtype, cache, write)
    o_lat = q_abs.new_empty(num_seqs, num_heads, rank)
    part_out, part_lse = split_partials(o_lat, num_splits)
    sparse_mla_decode(q_abs, cache, block_tables, seq_lens, pools, pool_size, rank, scale, num_splits, out=o_lat,
                      partials=(part_out, part_lse))
    return merge_expand(o_lat, part_out, part_lse, kv_b, v_dim, num_splits, q.dtype)


def pool_scores_ref(q, weights, index_cache, pool_bias, block_tables, seq_lens, weight_scale=1.0) -> torch.Tensor:
    """pool_scores per sequence in torch, as DsaIndexer.select computes them: [num_seqs, max_pools] float32."""
    pool_size, index_dim = pool_bias.shape
    weights = weights.float() * weight_scale
    page_size = index_cache.shape[2]
    out = torch.full((q.shape[0], block_tables.shape[1] * page_size // pool_size), float("-inf"), device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        nb = seq_len // pool_size
        if nb == 0:
            continue
        rows = index_cache[0, block_tables[i, : cdiv(seq_len, page_size)].long()].flatten(0, 1)[: nb * pool_size]
        keys, gates = rows.view(nb, pool_size, -1).split(index_dim, dim=-1)
        mix = torch.softmax(gates.float() + pool_bias.float(), dim=1).to(keys.dtype)
        pool_keys = (mix * keys).sum(dim=1)  # [nb, Di]
        s = torch.relu(torch.matmul(q[i].float(), pool_keys.float().t()) * index_dim**-0.5)  # [Ni, nb]
        out[i, :nb] = torch.matmul(weights[i, None, :], s)[0]
    return out


def sparse_mla_decode_ref(q, cache, block_tables, seq_lens, pools, pool_size, rank, scale) -> torch.Tensor:
    """sparse_mla_decode per sequence in float32 (the truth): softmax over the listed pools' keys j < seq_len."""
    page_size = cache.shape[2]
    out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        rows = cache[0, block_tables[i, : cdiv(seq_len, page_size)].long()].flatten(0, 1)[:seq_len].float()
        kept = torch.zeros(seq_len + pool_size, dtype=torch.bool, device=q.device)
        for pool in (p for p in pools[i].tolist() if p >= 0):
            kept[pool * pool_size : (pool + 1) * pool_size] = True
        scores = (q[i].float() @ rows.t() * scale).masked_fill(~kept[None, :seq_len], float("-inf"))  # [Nq, S]
        out[i] = (torch.softmax(scores, dim=-1) @ rows[:, :rank]).to(q.dtype)
    return out


def dsa_num_splits(num_listed: int, pool_size: int) -> int:
    """Splits along the listed pools: about 512 keys each, at most 16, from the config alone (eager and graphed decode
    then round alike whatever the batch)."""
    return max(1, min(num_listed, 16, cdiv(num_listed * pool_size, 512)))
