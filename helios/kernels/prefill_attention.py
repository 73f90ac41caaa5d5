"""Prefill and chunked-prefill attention: varlen queries attending causally to the paged KV cache.

Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1], its last tokens: the first sits at
position seq_lens[i] - num_query_tokens (= num_computed_tokens), and the cache already holds this chunk's
K/V. Program (query block, seq, kv_head) packs BLOCK_Q tokens x GROUP query heads into the BLOCK_M rows of
one tile, so each K/V tile loaded serves the whole GQA group. Keys before the block's window start and after
its last query are never loaded. Decode rows (one token) work here too, which is how a mixed batch runs.
Imports torch, helios.kernels._triton and helios.kernels.paged_attention (shared helpers and reference).
"""

from __future__ import annotations

import torch

from helios.kernels._triton import cdiv, jit, next_power_of_2, require_triton, tl
from helios.kernels.paged_attention import (
    _scores,
    _sink_start,
    check_paged_inputs,
    check_sinks,
    dot_precision,
    paged_attention_ref,
)


@jit
def _prefill_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    out_ptr,  # [num_tokens, num_heads, head_dim]
    sinks_ptr,  # [num_heads] sink logits, read when HAS_SINKS
    stride_qt,
    stride_qh,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    head_dim,
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,  # query heads per kv head
    PAGE_SIZE: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q * GROUP (+ padding to a power of two)
    BLOCK_Q: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # num_computed_tokens

    r = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + r // GROUP  # [BLOCK_M] token index within the sequence's queries
    heads = kv_head * GROUP + r % GROUP
    r_mask = (r < BLOCK_Q * GROUP) & (q_local < q_len)
    q_pos = first_pos + q_local
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    tokens = (q_start + q_local).to(tl.int64)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=r_mask[:, None] & d_mask[None, :],
        other=0.0,
    )

    # keys any row of this tile may see: [window start of its first query, its last query]
    hi = first_pos + tl.minimum((q_block + 1) * BLOCK_Q, q_len)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(first_pos + q_block * BLOCK_Q - window + 1, 0)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_SINKS:  # one more logit per row whose value is 0
        m, l = _sink_start(sinks_ptr, heads, r_mask, m, l)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        k_pos = start_n + tl.arange(0, BLOCK_N)
        k_mask = k_pos < hi
        block = tl.load(block_tables_ptr + seq * stride_bt + k_pos // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
        offset = block * stride_cp + (k_pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        kv_mask = k_mask[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        s = _scores(q, k, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        allowed = k_mask[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (k_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        # NOTE: a row may see no key of a whole tile (window rows of late queries, padded rows):
        # exponentiate against 0 there instead of -inf - -inf = nan.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=r_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim], holds this chunk's K/V
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32 (cu_seqlens_q)
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence after this chunk
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    max_query_len: int,  # host-side max of the query lengths (sizes the grid; no device sync)
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim]
    block_m: int | None = None,
    block_n: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    require_triton()
    num_seqs = seq_lens.shape[0]
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page_size, group = check_paged_inputs(q, kv_cache, block_tables, seq_lens, num_seqs)
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    out = torch.empty_like(q) if out is None else out
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    block_m = block_m or (128 if block_d <= 64 else 64)
    block_m = max(block_m, next_power_of_2(group), 16)  # a tile holds at least one token's whole group
    block_n = block_n or (64 if block_d <= 128 else 32)
    block_q = block_m // group
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    check_sinks(sinks, num_heads)
    grid = (cdiv(max_query_len, block_q), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        out,
        out if sinks is None else sinks,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        head_dim,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        GROUP=group,
        PAGE_SIZE=page_size,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_m <= 64 else 8,
        num_stages=2,
    )
    return out


def paged_prefill_attention_ref(
    q,
    kv_cache,
    query_start_loc,
    seq_lens,
    block_tables,
    max_query_len,
    scale,
    sliding_window=None,
    softcap=None,
    out=None,
    block_m=None,
    block_n=None,
    sinks=None,
):
    """paged_attention_ref (max_query_len and the block sizes do not change the math)."""
    result = paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, softcap,
                                 sinks)
    if out is not None:
        out.copy_(result)
        return out
    return result
