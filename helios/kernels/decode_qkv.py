"""Decode attention straight from the qkv projection: q/k norms, rotary, the cache write and attention in one launch.

The unfused decode path is two launches per layer: rotary_cache (norm + rotate q and k, write k and v to the
cache slot, q to a buffer) then the decode kernel (paged_attention), which can start reading the cache only
once the first has written the newest key. Here program (seq, kv_head, split) does both: every key but the
newest is in the cache from earlier steps, so its first block of keys and values, the block ids and the
cos/sin row are loaded before the PDL wait, beside the qkv projection's tail; after the wait it reads its
GQA group's q heads and the newest key and value from the qkv row, normalizes and rotates them as
rotary_cache does (same roundings: q and k are rounded to the cache dtype before any product), writes the
newest key and value into the cache (the program whose range holds the newest position), and attends the
cached keys plus the newest one, held in registers. Splits > 1 write partials; the last program of each
(sequence, kv head) to finish merges them inside the launch (an arrival counter; MERGE_IN_KERNEL=0: paged_attention's
merge kernel). A RowNorm first scales the qkv row by the residual stream's rstd (helios.models.llama's norm-free
layers). `decode_attention_qkv_ref` is rotary_and_cache_ref followed by paged_decode_attention_ref.
Imports torch and helios.kernels (_triton, gemv, paged_attention, rotary_cache) only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    COUNTER_SLOTS,
    arrival_counters,
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
)
from helios.kernels.gemv import RowNorm, row_rstd, times_rstd, times_rstd_ref
from helios.kernels.paged_attention import (
    _scaled,
    check_paged_inputs,
    dot_precision,
    merge_splits,
    paged_decode_attention_ref,
    split_partials,
)
from helios.kernels.rotary_cache import _halves, _norm_rotate, rotary_and_cache_ref

# keys per loop step at head_dim <= 128 (half above) and warps per program; benchmarks/gpu_decode.py tries others
BLOCK_N = 64
NUM_WARPS = 4
# splits > 1 merge in the launch (the last program of each (sequence, kv head) to finish), not in a second kernel;
# 0: paged_attention's merge kernel (benchmarks compare)
MERGE_IN_KERNEL = 1


@jit
def _decode_qkv_kernel(
    qkv_ptr,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim]
    cos_ptr,  # [num_seqs, head_dim]
    sin_ptr,  # [num_seqs, head_dim]
    q_norm_ptr,  # [head_dim], read only with HAS_NORM
    k_norm_ptr,  # [head_dim], read only with HAS_NORM
    slot_mapping_ptr,  # [num_seqs] int64, -1: no cache write (a padded row)
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32, keys including the newest
    out_ptr,  # [num_seqs, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    stride_bt,
    max_blocks,  # block table columns
    stride_os,
    stride_oh,
    num_heads,
    num_kv_heads,
    head_dim,
    scale,
    softcap,
    window,
    eps,
    GROUP: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
    # ROW_SCALE (one sequence): the qkv row is the projection of the un-normed residual stream (its norm weight
    # folded into the qkv weight); q, k and v are multiplied by the stream's rstd from a RowNorm first
    ROW_SCALE: tl.constexpr = False,
    P_BLOCK: tl.constexpr = 1,
    partials_ptr=None,
    num_partials=1,
    row_dim=1,
    row_eps=0.0,
    # MERGE (NUM_SPLITS > 1): the last program of a (sequence, kv head) to arrive at counter_ptr merges the splits
    MERGE: tl.constexpr = False,
    BLOCK_S: tl.constexpr = 1,  # next power of two >= NUM_SPLITS
    counter_ptr=None,  # [>= num_seqs * num_kv_heads] int32, zero
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    half = head_dim // 2
    c = tl.arange(0, BLOCK_HALF)
    cmask = c < half
    offs_n = tl.arange(0, BLOCK_N)

    # --- before the wait: what earlier kernels and steps wrote (paged_attention's NOTE on PDL) ---------------
    cols = c[None, :]
    row_mask = cmask[None, :]
    qw1 = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
    qw2 = qw1
    kw1 = qw1
    kw2 = qw1
    if HAS_NORM:
        qw1, qw2 = _halves(q_norm_ptr, cols, half, row_mask)
        kw1, kw2 = _halves(k_norm_ptr, cols, half, row_mask)
        qw1, qw2, kw1, kw2 = qw1.to(tl.float32), qw2.to(tl.float32), kw1.to(tl.float32), kw2.to(tl.float32)
    cos1, cos2 = _halves(cos_ptr + seq * stride_cos, cols, half, row_mask)
    sin1, sin2 = _halves(sin_ptr + seq * stride_sin, cols, half, row_mask)
    cos1, cos2, sin1, sin2 = cos1.to(tl.float32), cos2.to(tl.float32), sin1.to(tl.float32), sin2.to(tl.float32)
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the query sits at seq_len - 1
    table = block_tables_ptr + seq * stride_bt
    if NUM_SPLITS == 1 and not HAS_WINDOW:
        # the range starts at key 0: the first two blocks' ids load beside seq_len, not after it (the table's
        # columns past a sequence's blocks hold valid page ids or 0, and the K/V loads below are masked)
        start = 0
        pos = offs_n
        pos_next = pos + BLOCK_N
        block = tl.load(table + pos // PAGE_SIZE, mask=pos // PAGE_SIZE < max_blocks, other=0).to(tl.int64)
        block_next = tl.load(table + pos_next // PAGE_SIZE, mask=pos_next // PAGE_SIZE < max_blocks, other=0)
        block_next = block_next.to(tl.int64)
        end = seq_len
        cached_end = seq_len - 1  # the newest key comes from the qkv row, not the cache
    else:
        per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = lo + split * per_split
        end = tl.minimum(start + per_split, seq_len)
        cached_end = tl.minimum(end, seq_len - 1)
        pos = start + offs_n
        pos_next = pos + BLOCK_N
        block = tl.load(table + pos // PAGE_SIZE, mask=pos < cached_end, other=0).to(tl.int64)
        block_next = tl.load(table + pos_next // PAGE_SIZE, mask=pos_next < cached_end, other=0).to(tl.int64)
    head_off = kv_head * stride_ch
    offset = block * stride_cp + (pos % PAGE_SIZE) * stride_cs + head_off
    key_mask = (pos < cached_end)[:, None] & row_mask
    k1, k2 = _halves(k_cache_ptr + offset[:, None], cols, half, key_mask)
    v1, v2 = _halves(v_cache_ptr + offset[:, None], cols, half, key_mask)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)

    # --- the qkv row: this group's q heads, the newest key and value ------------------------------------
    row = qkv_ptr + seq * stride_qkv
    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    q_mask = (h < GROUP)[:, None] & row_mask
    rstd = 1.0
    if ROW_SCALE:
        rstd = row_rstd(partials_ptr, num_partials, row_dim, row_eps, P_BLOCK)
    q1, q2 = _halves(row + heads[:, None] * head_dim, cols, half, q_mask)
    q1 = times_rstd(q1, rstd, ROW_SCALE)
    q2 = times_rstd(q2, rstd, ROW_SCALE)
    r1, r2 = _norm_rotate(q1, q2, qw1, qw2, cos1, cos2, sin1, sin2, head_dim, eps, HAS_NORM, MULTIPLY_IN_FLOAT32)
    qa = r1.to(k1.dtype)  # rounded as rotary_cache stores q
    qb = r2.to(k1.dtype)
    n1, n2 = _halves(row + (num_heads + kv_head) * head_dim, cols, half, row_mask)
    n1 = times_rstd(n1, rstd, ROW_SCALE)
    n2 = times_rstd(n2, rstd, ROW_SCALE)
    kn1, kn2 = _norm_rotate(n1, n2, kw1, kw2, cos1, cos2, sin1, sin2, head_dim, eps, HAS_NORM, MULTIPLY_IN_FLOAT32)
    kn1 = kn1.to(k1.dtype)  # [1, BLOCK_HALF], as the cache holds it
    kn2 = kn2.to(k1.dtype)
    vn1, vn2 = _halves(row + (num_heads + num_kv_heads + kv_head) * head_dim, cols, half, row_mask)
    vn1 = times_rstd(vn1, rstd, ROW_SCALE)
    vn2 = times_rstd(vn2, rstd, ROW_SCALE)
    # the program whose range holds the newest position writes it to the cache (none for a padded row)
    owns_newest = (start < end) & (end == seq_len)
    slot = tl.load(slot_mapping_ptr + seq)
    slot_tile = tl.zeros([1, BLOCK_HALF], dtype=tl.int64) + slot  # a tile: a scalar mask term trips the interpreter
    write = row_mask & (slot_tile >= 0) & ((tl.zeros([1, BLOCK_HALF], dtype=tl.int32) + owns_newest) != 0)
    dst = (slot_tile // PAGE_SIZE) * stride_cp + (slot_tile % PAGE_SIZE) * stride_cs + head_off + cols
    tl.store(k_cache_ptr + dst, kn1, mask=write)
    tl.store(k_cache_ptr + dst + half, kn2, mask=write)
    tl.store(v_cache_ptr + dst, vn1, mask=write)
    tl.store(v_cache_ptr + dst + half, vn2, mask=write)

    # --- attention over the cached keys, one block in flight ahead --------------------------------------
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_H, BLOCK_HALF], dtype=tl.float32)
    for start_n in range(start, cached_end, BLOCK_N):
        k_mask = start_n + offs_n < cached_end
        pos_next = start_n + BLOCK_N + offs_n
        next_mask = (pos_next < cached_end)[:, None] & row_mask
        offset = block_next * stride_cp + (pos_next % PAGE_SIZE) * stride_cs + head_off
        k1_next, k2_next = _halves(k_cache_ptr + offset[:, None], cols, half, next_mask)
        v1_next, v2_next = _halves(v_cache_ptr + offset[:, None], cols, half, next_mask)
        pos_after = pos_next + BLOCK_N
        block_next = tl.load(table + pos_after // PAGE_SIZE, mask=pos_after < cached_end, other=0).to(tl.int64)
        raw = tl.dot(qa, tl.trans(k1), input_precision=DOT_PRECISION)
        raw = tl.dot(qb, tl.trans(k2), raw, input_precision=DOT_PRECISION)
        s = tl.where(k_mask[None, :], _scaled(raw, scale, softcap, HAS_SOFTCAP), float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        pv = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1, input_precision=DOT_PRECISION)
        acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2, input_precision=DOT_PRECISION)
        m = m_new
        k1 = k1_next
        k2 = k2_next
        v1 = v1_next
        v2 = v2_next
    if owns_newest:  # the newest key, from registers
        raw_new = tl.sum(qa.to(tl.float32) * kn1.to(tl.float32), axis=1)
        raw_new += tl.sum(qb.to(tl.float32) * kn2.to(tl.float32), axis=1)
        s_new = _scaled(raw_new, scale, softcap, HAS_SOFTCAP)  # [BLOCK_H]
        m_new = tl.maximum(m, s_new)
        alpha = tl.exp2(m - m_new)
        p_new = tl.exp2(s_new - m_new).to(vn1.dtype).to(tl.float32)  # rounded as the dot's operand would be
        l = l * alpha + tl.exp2(s_new - m_new)
        acc1 = acc1 * alpha[:, None] + p_new[:, None] * vn1.to(tl.float32)
        acc2 = acc2 * alpha[:, None] + p_new[:, None] * vn2.to(tl.float32)
        m = m_new

    # NOTE: an empty range (an empty split, a padded row with seq_len 0) leaves l == 0: output 0, lse -inf.
    inv = 1.0 / tl.where(l > 0, l, 1.0)
    o1 = acc1 * inv[:, None]
    o2 = acc2 * inv[:, None]
    if NUM_SPLITS == 1:
        out = out_ptr + seq * stride_os + heads[:, None] * stride_oh + cols
        tl.store(out, o1.to(out_ptr.dtype.element_ty), mask=q_mask)
        tl.store(out + half, o2.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        part = ((seq * num_heads + heads) * NUM_SPLITS + split)  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * head_dim + cols, o1, mask=q_mask)
        tl.store(part_out_ptr + part[:, None] * head_dim + half + cols, o2, mask=q_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h < GROUP)
        if MERGE:
            # every thread's partial stores are issued before the one release; the last to arrive acquires them
            tl.debug_barrier()
            counter = counter_ptr + seq * num_kv_heads + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == NUM_SPLITS - 1:
                _merge_group(part_out_ptr, part_lse_ptr, out_ptr + seq * stride_os, seq, heads, h < GROUP, cols,
                             row_mask, half, head_dim, num_heads, stride_oh, NUM_SPLITS, BLOCK_S)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@jit
def _merge_group(part_out_ptr, part_lse_ptr, out_ptr, seq, heads, h_mask, cols, row_mask, half, head_dim, num_heads,
                 stride_oh, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    """paged_attention's merge kernel for one GQA group's heads ([BLOCK_H]) inside the decode launch: the splits'
    partial outputs weighted by exp2(lse - max lse), in the same order. Loads bypass L1 (other SMs wrote them)."""
    s = tl.arange(0, BLOCK_S)
    s_mask = s < NUM_SPLITS
    rows = (seq * num_heads + heads)[:, None] * NUM_SPLITS + s[None, :]  # [BLOCK_H, BLOCK_S]
    lse = tl.load(part_lse_ptr + rows, mask=h_mask[:, None] & s_mask[None, :], other=float("-inf"),
                  cache_modifier=".cg")
    g = tl.max(lse, axis=1)
    g = tl.where(g == float("-inf"), 0.0, g)
    w = tl.exp2(lse - g[:, None])  # [BLOCK_H, BLOCK_S]; 0 for empty splits
    den = tl.sum(w, axis=1)
    inv = 1.0 / tl.where(den > 0, den, 1.0)
    mask3 = (h_mask[:, None] & s_mask[None, :])[:, :, None] & row_mask[None, :, :]
    base = part_out_ptr + rows[:, :, None] * head_dim + cols[None, :, :]  # [BLOCK_H, BLOCK_S, BLOCK_HALF]
    o1 = tl.load(base, mask=mask3, other=0.0, cache_modifier=".cg")
    o2 = tl.load(base + half, mask=mask3, other=0.0, cache_modifier=".cg")
    r1 = tl.sum(w[:, :, None] * o1, axis=1) * inv[:, None]
    r2 = tl.sum(w[:, :, None] * o2, axis=1) * inv[:, None]
    out = out_ptr + heads[:, None] * stride_oh + cols
    store_mask = h_mask[:, None] & row_mask
    tl.store(out, r1.to(out_ptr.dtype.element_ty), mask=store_mask)
    tl.store(out + half, r2.to(out_ptr.dtype.element_ty), mask=store_mask)


def decode_attention_qkv(
    qkv: torch.Tensor,  # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], one decode token per sequence
    cos: torch.Tensor,  # [num_seqs, head_dim]
    sin: torch.Tensor,  # [num_seqs, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim], the newest k, v written here
    slot_mapping: torch.Tensor,  # [num_seqs] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence including the newest
    num_heads: int,
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    q_norm: torch.Tensor | None = None,  # [head_dim], with k_norm: per-head RMSNorm of q and k (qwen3, gemma3)
    k_norm: torch.Tensor | None = None,
    eps: float = 1e-6,
    multiply_in_float32: bool = False,
    num_splits: int = 1,
    block_n: int | None = None,
    row_norm: RowNorm | None = None,  # one sequence: qkv is the projection of the un-normed stream (see below)
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """rotary_and_cache then paged_decode_attention, in one launch (two with splits > 1: the merge).

    row_norm: the qkv row is x @ W'.T with x the residual stream before its RMSNorm and W' the qkv weight with
    the norm weight folded in (helios.runner.norm_folding.fold_norm_weights); q, k and v are first multiplied by x's
    rstd and rounded, which is what the norm kernel + projection would have written."""
    require_triton()
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_pages, page_size, Nkv, D]"
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    num_seqs = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, f"qkv {tuple(qkv.shape)}"
    assert head_dim % 2 == 0 and head_dim >= 32, "rotary halves of at least 16"
    assert cos.shape == sin.shape == (num_seqs, head_dim), f"cos/sin {tuple(cos.shape)}: one row per sequence"
    assert slot_mapping.shape == (num_seqs,) and slot_mapping.dtype == torch.int64
    assert (q_norm is None) == (k_norm is None), "q and k norms come together"
    q_view = qkv[:, : num_heads * head_dim].view(num_seqs, num_heads, head_dim)
    check_paged_inputs(q_view, kv_cache, block_tables, seq_lens, num_seqs)
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    assert num_splits >= 1
    out = torch.empty(num_seqs, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_seqs == 0:
        return out
    block_half = next_power_of_2(head_dim // 2)
    block_n = block_n or (BLOCK_N if head_dim <= 128 else BLOCK_N // 2)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pdl = use_pdl(qkv, num_seqs)
    part_out, part_lse = split_partials(out, num_splits)
    merge = num_splits > 1 and MERGE_IN_KERNEL and num_seqs * num_kv_heads <= COUNTER_SLOTS
    merge_args = {}
    if merge:
        merge_args = dict(MERGE=True, BLOCK_S=next_power_of_2(num_splits), counter_ptr=arrival_counters(qkv.device, "decode_qkv"))
    has_norm = q_norm is not None
    group = num_heads // num_kv_heads
    row_args = {}
    if row_norm is not None:
        assert num_seqs == 1, "a RowNorm scales one row"
        partials = row_norm.partials
        assert partials.dtype == torch.float32 and partials.dim() == 1 and partials.is_contiguous()
        row_args = dict(ROW_SCALE=True, P_BLOCK=next_power_of_2(partials.numel()), partials_ptr=partials,
                        num_partials=partials.numel(), row_dim=row_norm.dim, row_eps=row_norm.eps)
    _decode_qkv_kernel[(num_seqs, num_kv_heads, num_splits)](
        qkv,
        cos,
        sin,
        q_norm if has_norm else cos,
        k_norm if has_norm else cos,
        slot_mapping,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        block_tables.shape[1],
        out.stride(0),
        out.stride(1),
        num_heads,
        num_kv_heads,
        head_dim,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        eps,
        GROUP=group,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_NORM=has_norm,
        MULTIPLY_IN_FLOAT32=multiply_in_float32,
        BLOCK_H=max(16, next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_N=block_n,
        BLOCK_HALF=block_half,
        DOT_PRECISION=dot_precision(qkv.dtype),
        USE_PDL=pdl,
        num_warps=NUM_WARPS,
        num_stages=1,
        launch_pdl=pdl,
        **row_args,
        **merge_args,
    )
    if not merge:
        merge_splits(part_out, part_lse, out, num_splits, pdl)
    return out


def decode_attention_qkv_ref(
    qkv, cos, sin, kv_cache, slot_mapping, block_tables, seq_lens, num_heads, scale, sliding_window=None,
    softcap=None, q_norm=None, k_norm=None, eps=1e-6, multiply_in_float32=False, num_splits=1, block_n=None,
    row_norm=None,
) -> torch.Tensor:
    """The two-launch path's references: rotary_and_cache_ref (writes the cache), then decode attention."""
    if row_norm is not None:
        qkv = times_rstd_ref(qkv, row_norm)
    q = rotary_and_cache_ref(qkv, cos, sin, kv_cache, slot_mapping, num_heads, q_norm, k_norm, eps,
                             multiply_in_float32)
    return paged_decode_attention_ref(q, kv_cache, block_tables, seq_lens, scale, sliding_window, softcap)
