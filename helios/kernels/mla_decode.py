"""Multi-head latent attention decode over the paged latent cache (the absorbed form), and the latent cache write.

Each token's page row is its latent c [R] and its rope key k_r [dr] (helios.layers.mla); a decode query per head is
[q_nope W_uk (R wide), q_rope (dr)], absorbed by the layer before the launch. Scores are q . row, the output is the
softmax-weighted sum of the latents c (the layer applies W_uv after): one-head MQA of width R + dr whose value is
the key's first R dims. Program (seq, head block, split) reads each key row once for BLOCK_H query heads, the point
of MLA decode; splits along the sequence merge in paged_attention's reduce kernel. Lengths and block tables are
read on the device and the split count is a launch constant, so a captured CUDA graph stays valid.
mla_decode_absorbed is the whole absorbed form in three launches (a batch-1 decode step counts them): the query
absorption and rope concat in one (absorb_query), the attention, and the split merge with W_uv's up-projection in one.
Imports torch and helios.kernels only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from helios.kernels._triton import cdiv, check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.paged_attention import choose_num_splits, dot_precision, merge_splits, split_partials
from helios.kernels.rmsnorm import WEIGHT_AFTER, _normalize
from helios.kernels.sparse_decode import online_softmax_tile, store_decode_output

LOG2E = 1.4426950408889634
NORM_WEIGHT_AFTER = tl.constexpr(WEIGHT_AFTER)  # a jit function reads a global only as a constexpr


class LatentWrite(NamedTuple):
    """write_latent's arguments after the cache: this step's rows for the latent cache (the norm folded in where
    norm_weight is given)."""

    latent: torch.Tensor  # [T, R]
    rope_key: torch.Tensor  # [T, dr]
    slot_mapping: torch.Tensor  # [T] int64, -1 = skip
    norm_weight: torch.Tensor | None = None  # [R]: `latent` is before its RMSNorm
    eps: float = 0.0
    multiply_in_float32: bool = False


@jit
def _write_latent_kernel(
    latent_ptr,  # [num_tokens, R]
    rope_ptr,  # [num_tokens, dr]
    cache_ptr,  # [num_pages, page_size, R + dr]
    slot_mapping_ptr,  # [num_tokens] int64, -1: a padded row (writes nothing)
    norm_w_ptr,  # [R] the latent's RMSNorm weight (NORM)
    stride_lt,
    stride_rt,
    stride_cp,
    stride_cs,
    rank,
    rope_dim,
    eps,
    PAGE_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,  # >= R + dr
    NORM: tl.constexpr,  # the latent goes through its RMSNorm first (helios.kernels.rmsnorm's numerics)
    MULTIPLY_IN_FLOAT32: tl.constexpr,
):
    _write_latent_row(tl.program_id(0).to(tl.int64), latent_ptr, rope_ptr, cache_ptr, slot_mapping_ptr, norm_w_ptr,
                      stride_lt, stride_rt, stride_cp, stride_cs, rank, rope_dim, eps, PAGE_SIZE, BLOCK, NORM,
                      MULTIPLY_IN_FLOAT32)


@jit
def _write_latent_row(t, latent_ptr, rope_ptr, cache_ptr, slot_mapping_ptr, norm_w_ptr, stride_lt, stride_rt,
                      stride_cp, stride_cs, rank, rope_dim, eps, PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr,
                      NORM: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr):
    """Token t's [latent (normed), rope key] into its slot (nothing for slot -1)."""
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK)
    slot = tl.zeros([BLOCK], dtype=tl.int64) + slot  # as a tile: a scalar mask term trips the interpreter
    is_latent = d < rank
    is_rope = (d >= rank) & (d < rank + rope_dim)
    live = slot >= 0
    c = tl.load(latent_ptr + t * stride_lt + d, mask=is_latent & live, other=0.0)
    if NORM:  # rounded to the latent's dtype, as the norm's own launch stores it
        w = tl.load(norm_w_ptr + d, mask=is_latent, other=0.0).to(tl.float32)
        c = _normalize(c, w, rank, eps, NORM_WEIGHT_AFTER, MULTIPLY_IN_FLOAT32).to(c.dtype)
    r = tl.load(rope_ptr + t * stride_rt + (d - rank), mask=is_rope & live, other=0.0)
    row = tl.where(is_latent, c, r)
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + d
    tl.store(cache_ptr + dst, row.to(cache_ptr.dtype.element_ty), mask=(is_latent | is_rope) & live)


def write_latent(
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr], written in place
    latent: torch.Tensor,  # [T, R], after its norm
    rope_key: torch.Tensor,  # [T, dr]
    slot_mapping: torch.Tensor,  # [T] int64, -1 = skip
    norm_weight: torch.Tensor | None = None,  # [R]: `latent` is before its RMSNorm, normalized here
    eps: float = 0.0,
    multiply_in_float32: bool = False,
) -> None:
    """Each token's [latent, rope key] into its slot, in the cache dtype; no concatenated copy, padded rows skip.
    With norm_weight the latent's RMSNorm runs here first, as helios.kernels.rmsnorm.rms_norm computes it (its
    launch folded in; the weight in the latent's dtype unless multiplied in float32, where that kernel takes it)."""
    require_triton()
    write = LatentWrite(latent, rope_key, slot_mapping, norm_weight, eps, multiply_in_float32)
    if latent.shape[0] == 0:
        return
    _write_latent_kernel[(latent.shape[0],)](**_write_args(cache, write), rank=latent.shape[1],
                                             rope_dim=rope_key.shape[1], num_warps=4)


def _write_args(cache: torch.Tensor, w: LatentWrite) -> dict:
    """The write's checked arguments by their kernel names (_write_latent_kernel's, also _absorb_query_kernel's),
    all but rank and rope_dim."""
    num_tokens, rank = w.latent.shape
    rope_dim = w.rope_key.shape[1]
    assert cache.dim() == 4 and cache.shape[0] == 1 and cache.shape[3] == rank + rope_dim, tuple(cache.shape)
    assert w.rope_key.shape[0] == num_tokens and w.slot_mapping.shape == (num_tokens,)
    assert w.slot_mapping.dtype == torch.int64
    for name, t in (("latent", w.latent), ("rope_key", w.rope_key), ("cache", cache)):
        check_last_dim_contiguous(name, t)
    if w.norm_weight is not None:
        assert w.norm_weight.shape == (rank,) and w.norm_weight.is_contiguous()
        assert w.multiply_in_float32 or w.norm_weight.dtype == w.latent.dtype, "a 16-bit latent, a float32 weight"
    pages = cache[0]
    return dict(latent_ptr=w.latent, rope_ptr=w.rope_key, cache_ptr=pages, slot_mapping_ptr=w.slot_mapping,
                norm_w_ptr=w.norm_weight if w.norm_weight is not None else w.latent, stride_lt=w.latent.stride(0),
                stride_rt=w.rope_key.stride(0), stride_cp=pages.stride(0), stride_cs=pages.stride(1), eps=w.eps,
                PAGE_SIZE=cache.shape[2], BLOCK=next_power_of_2(rank + rope_dim), NORM=w.norm_weight is not None,
                MULTIPLY_IN_FLOAT32=w.multiply_in_float32)


def write_latent_ref(cache, latent, rope_key, slot_mapping) -> None:
    """helios.layers.mla.write_latent, skipping negative slots."""
    keep = slot_mapping >= 0
    flat = cache.view(-1, cache.shape[-1])  # [num_slots, R + dr]
    flat.index_copy_(0, slot_mapping[keep], torch.cat([latent, rope_key], dim=-1)[keep].to(cache.dtype))


@jit
def _mla_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, R + dr], absorbed queries
    cache_ptr,  # [num_pages, page_size, R + dr]
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, R], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, R] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    stride_qs,
    stride_qh,
    stride_cp,  # cache strides: page, slot in page
    stride_cs,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    rank,
    rope_dim,
    scale,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head_block = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    # a split covers whole BLOCK_N blocks; trailing splits of a short sequence (and a padded row, length 0) are empty
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt

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

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
    # the page ids of the first key block; the loop keeps the next block's ids in flight while it computes
    pos = start + offs_n
    block = tl.load(table + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)
    for start_n in range(start, end, BLOCK_N):
        pos = start_n + offs_n
        k_mask = pos < end
        pos_next = pos + BLOCK_N
        block_next = tl.load(table + pos_next // PAGE_SIZE, mask=pos_next < end, other=0).to(tl.int64)
        row = block * stride_cp + (pos % PAGE_SIZE) * stride_cs  # [BLOCK_N]
        # the latent row, read once for every head of the block: key (with the rope part) and value at once
        c = tl.load(cache_ptr + row[:, None] + r[None, :], mask=k_mask[:, None] & r_mask[None, :], other=0.0)
        s = tl.dot(q_lat, tl.trans(c), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        if HAS_ROPE:
            k_pe = tl.load(cache_ptr + row[:, None] + rank + e[None, :], mask=k_mask[:, None] & e_mask[None, :],
                           other=0.0)
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision=DOT_PRECISION)
        s = tl.where(k_mask[None, :], s * qk_scale, float("-inf"))
        m, l, acc = online_softmax_tile(s, m, l, acc, c, DOT_PRECISION)  # the latent row is the value too
        block = block_next

    # NOTE: an empty range (an empty split, or a padded row with seq_len 0) leaves l == 0: output 0, lse -inf
    store_decode_output(acc, m, l, out_ptr, part_out_ptr, part_lse_ptr, seq, heads, h_mask, r, r_mask,
                        stride_os, stride_oh, num_heads, rank, split, NUM_SPLITS)


def mla_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, R + dr], [q_nope W_uk, q_rope] per head
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence including this token's (0: a padded row)
    rank: int,  # R: the latent's width, the output's
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, R]
    block_h: int = 16,
    block_n: int | None = None,
    partials: tuple[torch.Tensor, torch.Tensor] | None = None,  # split_partials(out, num_splits): left unmerged
) -> torch.Tensor:  # [num_seqs, num_heads, R], the attention-weighted latents (in q's dtype)
    """num_splits is a launch constant (never read from seq_lens), so a captured CUDA graph stays valid; float32
    accumulation throughout, the splits merged in float32. Given `partials`, the splits' partial outputs stay there
    for the caller's merge (mla_decode_absorbed's) and `out` is written only with one split."""
    require_triton()
    num_seqs, num_heads, width = q.shape
    assert cache.dim() == 4 and cache.shape[0] == 1, f"cache must be [1, num_pages, page_size, R + dr]: {cache.shape}"
    assert cache.shape[3] == width and 0 < rank <= width, f"q width {width}, cache {tuple(cache.shape)}, rank {rank}"
    assert q.dtype == cache.dtype, f"q {q.dtype} and cache {cache.dtype} must share a dtype"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    assert num_splits >= 1 and block_h >= 16, "tl.dot needs at least 16 rows"
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("cache", cache)
    out = q.new_empty(num_seqs, num_heads, rank) if out is None else out
    assert out.shape == (num_seqs, num_heads, rank) and out.stride(-1) == 1 and out.dtype == q.dtype
    if num_seqs == 0:
        return out
    pages = cache[0]
    rope_dim = width - rank
    block_r = max(16, next_power_of_2(rank))
    block_n = block_n or (32 if block_r <= 256 else 16)
    part_out, part_lse = partials or split_partials(out, num_splits)
    _mla_decode_kernel[(num_seqs, cdiv(num_heads, block_h), num_splits)](
        q, pages, block_tables, seq_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), pages.stride(0), pages.stride(1), block_tables.stride(0), out.stride(0),
        out.stride(1), num_heads, rank, rope_dim, scale,
        PAGE_SIZE=cache.shape[2],
        NUM_SPLITS=num_splits,
        HAS_ROPE=rope_dim > 0,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_DR=max(16, next_power_of_2(rope_dim)),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_r <= 256 else 8,
        num_stages=2,
    )
    if partials is None:
        merge_splits(part_out, part_lse, out, num_splits, False)
    return out


@jit
def _absorb_query_kernel(
    q_ptr,  # [num_seqs, num_heads, dn + dr]
    kv_b_ptr,  # [num_heads * (dn + dv), R]: per head dn W_uk rows, then dv W_uv rows
    out_ptr,  # [num_seqs, num_heads, R + dr] contiguous
    stride_qs,
    stride_qh,
    num_heads,
    nope_dim,
    v_dim,
    rank,
    rope_dim,
    # WRITE: this step's latent rows into the cache (token t = sequence t), _write_latent_kernel's arguments
    latent_ptr, rope_ptr, cache_ptr, slot_mapping_ptr, norm_w_ptr, stride_lt, stride_rt, stride_cp, stride_cs, eps,
    BLOCK_DN: tl.constexpr,  # >= dn
    BLOCK_R: tl.constexpr,  # the latent columns of one program
    BLOCK_DR: tl.constexpr,  # >= dr
    WRITE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr, NORM: tl.constexpr, MULTIPLY_IN_FLOAT32: tl.constexpr,
):
    # program (seq, head, latent block): q_lat[r] = sum_i q_nope[i] W_uk[i, r] in float32, rounded to q's dtype (as
    # the bmm it replaces rounds), then stored in the output's; latent block 0 also copies the rope part. WRITE:
    # program (seq, num_heads, 0) writes the sequence's latent row (the attention's next launch reads it)
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    if WRITE and head == num_heads:
        if tl.program_id(2) == 0:
            _write_latent_row(seq, latent_ptr, rope_ptr, cache_ptr, slot_mapping_ptr, norm_w_ptr, stride_lt,
                              stride_rt, stride_cp, stride_cs, rank, rope_dim, eps, PAGE_SIZE, BLOCK, NORM,
                              MULTIPLY_IN_FLOAT32)
    else:
        _absorb_block(seq, head, q_ptr, kv_b_ptr, out_ptr, stride_qs, stride_qh, num_heads, nope_dim, v_dim, rank,
                      rope_dim, BLOCK_DN, BLOCK_R, BLOCK_DR)


@jit
def _absorb_block(seq, head, q_ptr, kv_b_ptr, out_ptr, stride_qs, stride_qh, num_heads, nope_dim, v_dim, rank,
                  rope_dim, BLOCK_DN: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DR: tl.constexpr):
    r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = r < rank
    i = tl.arange(0, BLOCK_DN)
    i_mask = i < nope_dim
    q_row = q_ptr + seq * stride_qs + head * stride_qh
    q_nope = tl.load(q_row + i, mask=i_mask, other=0.0)
    w_uk = tl.load(kv_b_ptr + (head * (nope_dim + v_dim) + i)[:, None] * rank + r[None, :],
                   mask=i_mask[:, None] & r_mask[None, :], other=0.0)  # [BLOCK_DN, BLOCK_R]
    q_lat = tl.sum(q_nope.to(tl.float32)[:, None] * w_uk.to(tl.float32), axis=0).to(q_nope.dtype)
    out_row = out_ptr + (seq * num_heads + head) * (rank + rope_dim)
    tl.store(out_row + r, q_lat.to(out_ptr.dtype.element_ty), mask=r_mask)
    if tl.program_id(2) == 0:
        e = tl.arange(0, BLOCK_DR)
        e_mask = e < rope_dim
        q_pe = tl.load(q_row + nope_dim + e, mask=e_mask, other=0.0)
        tl.store(out_row + rank + e, q_pe.to(out_ptr.dtype.element_ty), mask=e_mask)


def absorb_query(
    q: torch.Tensor,  # [num_seqs, num_heads, dn + dr]
    kv_b: torch.Tensor,  # [num_heads * (dn + dv), R]
    rank: int,
    v_dim: int,
    dtype: torch.dtype,  # the output's (the latent cache's)
    cache: torch.Tensor | None = None,  # [1, num_pages, page_size, R + dr], with `write`
    write: LatentWrite | None = None,  # one row per sequence: written into `cache` in the same launch
) -> torch.Tensor:  # [num_seqs, num_heads, R + dr]
    """helios.layers.mla.absorb_query (then .to(dtype)) in one launch: [q_nope W_uk, q_rope] per head, q_nope W_uk
    summed in float32 and rounded to q's dtype first. With `write` the launch also writes the decode rows' latents
    (write_latent's work, its launch folded in)."""
    require_triton()
    num_seqs, num_heads, width = q.shape
    nope_dim = kv_b.shape[0] // num_heads - v_dim
    rope_dim = width - nope_dim
    assert kv_b.shape == (num_heads * (nope_dim + v_dim), rank) and kv_b.is_contiguous() and 0 <= rope_dim
    check_last_dim_contiguous("q", q)
    out = torch.empty(num_seqs, num_heads, rank + rope_dim, dtype=dtype, device=q.device)
    if write is not None:
        assert write.latent.shape[0] == num_seqs and cache is not None, "one latent row per sequence, and the cache"
        write_args = _write_args(cache, write)
    else:
        write_args = dict(latent_ptr=q, rope_ptr=q, cache_ptr=q, slot_mapping_ptr=q, norm_w_ptr=q, stride_lt=0,
                          stride_rt=0, stride_cp=0, stride_cs=0, eps=0.0, PAGE_SIZE=1, BLOCK=1, NORM=False,
                          MULTIPLY_IN_FLOAT32=False)
    if num_seqs == 0:
        return out
    block_r = min(64, next_power_of_2(rank))
    _absorb_query_kernel[(num_seqs, num_heads + (write is not None), cdiv(rank, block_r))](
        q, kv_b, out, q.stride(0), q.stride(1), num_heads, nope_dim, v_dim, rank, rope_dim, **write_args,
        BLOCK_DN=next_power_of_2(nope_dim), BLOCK_R=block_r, BLOCK_DR=max(2, next_power_of_2(rope_dim)),
        WRITE=write is not None, num_warps=4,
    )
    return out


@jit
def _merge_expand_kernel(
    lat_ptr,  # [num_seqs, num_heads, R] the attention's latent output (NUM_SPLITS == 1)
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, R] float32 (NUM_SPLITS > 1)
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    kv_b_ptr,  # [num_heads * (dn + dv), R]
    out_ptr,  # [num_seqs, num_heads, dv] contiguous
    num_heads,
    nope_dim,
    v_dim,
    rank,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,  # >= NUM_SPLITS
    BLOCK_V: tl.constexpr,  # the value columns of one program
    BLOCK_R: tl.constexpr,  # latent columns per step
):
    # program (seq, head, value block): the latent output o_lat (the splits merged as paged_attention's reduce does,
    # rounded to lat's dtype as that reduce stores it), then out[j] = sum_r W_uv[j, r] o_lat[r] in float32, rounded
    # to out's dtype
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    j_mask = j < v_dim
    w_rows = kv_b_ptr + (head * (nope_dim + v_dim) + nope_dim + j)[:, None] * rank
    row = seq * num_heads + head
    if NUM_SPLITS > 1:
        splits = tl.arange(0, BLOCK_S)
        s_mask = splits < NUM_SPLITS
        lse = tl.load(part_lse_ptr + row * NUM_SPLITS + splits, mask=s_mask, other=float("-inf"))
        g = tl.max(lse, axis=0)
        g = tl.where(g == float("-inf"), 0.0, g)
        w = tl.exp2(lse - g)  # [BLOCK_S]; 0 for empty splits
        den = tl.sum(w, axis=0)
        den = tl.where(den > 0, den, 1.0)
    acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        r_mask = r < rank
        if NUM_SPLITS > 1:
            parts = tl.load(part_out_ptr + (row * NUM_SPLITS + splits)[:, None] * rank + r[None, :],
                            mask=s_mask[:, None] & r_mask[None, :], other=0.0)
            o_lat = (tl.sum(w[:, None] * parts, axis=0) / den).to(lat_ptr.dtype.element_ty)
        else:
            o_lat = tl.load(lat_ptr + row * rank + r, mask=r_mask, other=0.0)
        o_lat = o_lat.to(out_ptr.dtype.element_ty).to(tl.float32)
        w_uv = tl.load(w_rows + r[None, :], mask=j_mask[:, None] & r_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w_uv * o_lat[None, :], axis=1)
    tl.store(out_ptr + row * v_dim + j, acc.to(out_ptr.dtype.element_ty), mask=j_mask)


def mla_decode_absorbed(
    q: torch.Tensor,  # [num_seqs, num_heads, dn + dr], one query token per sequence
    kv_b: torch.Tensor,  # [num_heads * (dn + dv), R]: per head dn W_uk rows, then dv W_uv rows
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    v_dim: int,
    scale: float,
    num_splits: int = 1,
    write: LatentWrite | None = None,  # this step's latent rows, one per sequence: written by the first launch
) -> torch.Tensor:  # [num_seqs, num_heads, dv] in q's dtype
    """helios.layers.mla's absorbed decode in three launches: absorb_query (the absorbed query in the cache's dtype;
    with `write` also the cache write), the attention over the latent pages (mla_decode's kernel), then the split
    merge and W_uv's up-projection per (seq, head). Each row's values depend on its own sequence only; graph-safe as
    mla_decode."""
    num_seqs, num_heads, _ = q.shape
    rank = kv_b.shape[1]
    q_abs = absorb_query(q, kv_b, rank, v_dim, cache.dtype, cache, write)
    o_lat = q_abs.new_empty(num_seqs, num_heads, rank)
    part_out, part_lse = split_partials(o_lat, num_splits)
    mla_decode(q_abs, cache, block_tables, seq_lens, rank, scale, num_splits, out=o_lat, partials=(part_out, part_lse))
    return merge_expand(o_lat, part_out, part_lse, kv_b, v_dim, num_splits, q.dtype)


def merge_expand(
    o_lat: torch.Tensor,  # [num_seqs, num_heads, R] the attention's output (num_splits == 1)
    part_out: torch.Tensor,  # split_partials' pair for num_splits > 1
    part_lse: torch.Tensor,
    kv_b: torch.Tensor,  # [num_heads * (nope + dv), R]
    v_dim: int,
    num_splits: int,
    dtype: torch.dtype,
) -> torch.Tensor:  # [num_seqs, num_heads, dv] in dtype
    """The absorbed decodes' last launch (mla_decode_absorbed, dsa_decode.sparse_mla_decode_absorbed): the split
    merge and W_uv's up-projection per (seq, head)."""
    num_seqs, num_heads, rank = o_lat.shape
    out = torch.empty(num_seqs, num_heads, v_dim, dtype=dtype, device=o_lat.device)
    if num_seqs == 0:
        return out
    nope_dim = kv_b.shape[0] // num_heads - v_dim
    block_v = min(32, next_power_of_2(v_dim))
    _merge_expand_kernel[(num_seqs, num_heads, cdiv(v_dim, block_v))](
        o_lat, part_out, part_lse, kv_b, out, num_heads, nope_dim, v_dim, rank, NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits), BLOCK_V=block_v, BLOCK_R=min(128, next_power_of_2(rank)), num_warps=4,
    )
    return out


def mla_decode_ref(
    q: torch.Tensor,  # [num_seqs, num_heads, R + dr]
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rank: int,
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, R]
    """The absorbed attention per sequence in float32 (the truth); a row of length 0 gives zeros."""
    page_size = cache.shape[2]
    out = torch.zeros(q.shape[0], q.shape[1], rank, dtype=q.dtype, device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[i, : cdiv(seq_len, page_size)].long()
        rows = cache[0, pages].flatten(0, 1)[:seq_len].float()  # [S, R + dr]
        probs = torch.softmax(q[i].float() @ rows.t() * scale, dim=-1)  # [Nq, S]
        out[i] = (probs @ rows[:, :rank]).to(q.dtype)
    return out


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


def mla_num_splits(
    pinned: int | None, max_seq_len: int, num_seqs: int, num_heads: int, device: torch.device, block_h: int = 16
) -> int:
    """The split count of an MLA decode launch: choose_num_splits' rule over (seq, head block) programs, at least
    `pinned` (TritonAttentionBackend.decode_num_splits).
    NOTE: a CUDA graph pins the backend's count sized for (rows x kv heads) programs, and an MLA arch's kv heads are
    its query heads (128: 3 splits at batch 1, 24 programs here); capture's metadata says max_model_len for every
    row, so the rule gives each graph its own constant (graph-safe) sized for this kernel's programs instead."""
    own = choose_num_splits(max_seq_len, num_seqs, cdiv(num_heads, block_h), _num_sms(device))
    return max(pinned or 1, own)
