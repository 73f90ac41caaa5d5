"""Block-sparse decode attention (minimax_m3's MSA, helios.layers.msa): the lightning indexer's block scores over the
paged index keys, the top-k block choice, and attention over the chosen blocks' keys, for one query token per
sequence with every length and page read on the device (no host sync, no data-dependent shape: CUDA-graph safe).

Why two Triton kernels around a torch sort: the costs that grow with the context are reading every index key (the
scores) and the chosen blocks' K/V (the attention), and a kernel reads only up to each sequence's length through its
block table, where static-shape torch ops would gather a graph bucket's whole table width (max_model_len keys) per
row and layer. The choice between the scores is tiny ([B, Ni, max blocks] float32): `torch.sort(stable=True)` picks
it with the reference's own call, so ties go to the earlier block by construction (helios.layers.msa.LightningIndexer
.select); a top-k of num_blocks out of a few thousand blocks costs nothing beside the two kernels.
Imports torch and helios.kernels only.
"""

from __future__ import annotations

import math

import torch

from helios.kernels._triton import cdiv, check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.paged_attention import dot_precision, merge_splits, split_partials


@jit
def _block_scores_kernel(
    q_ptr,  # [num_seqs, num_index_heads, index_dim], the index queries (normed, rotated)
    index_ptr,  # [num_pages, page_size, index_dim], the index keys
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32 (0: a padded row, every score -inf)
    out_ptr,  # [num_seqs, num_index_heads, num_index_blocks] float32
    stride_qs,
    stride_qh,
    stride_ip,  # index cache strides: page, slot in page
    stride_is,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    index_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # the indexer's block of keys
    LOCAL_BLOCKS: tl.constexpr,  # > 0: the sequence's last LOCAL_BLOCKS blocks score +inf (select_blocks' boost)
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, index block): max over the block's keys j < seq_len of q_h . k_j in float32, per index head; with
    LOCAL_BLOCKS, the local blocks +inf and -0.0 written +0.0 (select_blocks' masked_fill and + 0.0)."""
    seq = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    heads = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = heads < num_heads
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & (d[None, :] < index_dim), other=0.0)
    best = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    start = blk * BLOCK_SIZE
    end = tl.minimum(start + BLOCK_SIZE, seq_len)
    table = block_tables_ptr + seq * stride_bt
    for n0 in range(0, BLOCK_SIZE, BLOCK_N):
        pos = start + n0 + tl.arange(0, BLOCK_N)
        k_mask = pos < end
        page = tl.load(table + pos // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
        row = page * stride_ip + (pos % PAGE_SIZE) * stride_is
        k = tl.load(index_ptr + row[:, None] + d[None, :], mask=k_mask[:, None] & (d[None, :] < index_dim),
                    other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_H, BLOCK_N]
        s = tl.where(k_mask[None, :], s, float("-inf"))
        best = tl.maximum(best, tl.max(s, axis=1))
    if LOCAL_BLOCKS > 0:
        num_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE  # the sequence's blocks; its own is the last
        is_local = (blk < num_blocks) & (blk >= num_blocks - LOCAL_BLOCKS)
        best = tl.where(is_local, float("inf"), tl.where(best == 0.0, 0.0, best))
    tl.store(out_ptr + seq * stride_os + heads * stride_oh + blk, best, mask=h_mask)


def block_scores(
    q: torch.Tensor,  # [num_seqs, num_index_heads, index_dim]
    index_cache: torch.Tensor,  # [1, num_pages, page_size, index_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence including this token's
    block_size: int,
    local_blocks: int = 0,  # > 0: the sequence's last local_blocks blocks score +inf, as select_blocks boosts them
) -> torch.Tensor:  # [num_seqs, num_index_heads, cdiv(max_pages * page_size, block_size)] float32
    """Each index block's score per index head (-inf for a block past the sequence's end). The block count comes from
    the table's width, never from the lengths: a graph's shapes are its bucket's. With local_blocks the scores are
    select_blocks' boosted ones (top_blocks then chooses in one sort)."""
    require_triton()
    num_seqs, num_heads, index_dim = q.shape
    assert index_cache.dim() == 4 and index_cache.shape[0] == 1 and index_cache.shape[3] == index_dim
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("index_cache", index_cache)
    page_size = index_cache.shape[2]
    num_blocks = cdiv(block_tables.shape[1] * page_size, block_size)
    out = torch.empty(num_seqs, num_heads, num_blocks, dtype=torch.float32, device=q.device)
    if num_seqs == 0:
        return out
    q = q.to(index_cache.dtype)  # the cache's dtype, as the model's: tl.dot takes one dtype
    pages = index_cache[0]
    _block_scores_kernel[(num_seqs, num_blocks)](
        q, pages, block_tables, seq_lens, out, q.stride(0), q.stride(1), pages.stride(0), pages.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_heads, index_dim,
        PAGE_SIZE=page_size, BLOCK_SIZE=block_size, LOCAL_BLOCKS=local_blocks,
        BLOCK_H=max(16, next_power_of_2(num_heads)),
        BLOCK_N=max(16, min(64, next_power_of_2(block_size))), BLOCK_D=max(16, next_power_of_2(index_dim)),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
    )
    return out


def select_blocks(
    scores: torch.Tensor,  # [num_seqs, num_index_heads, num_index_blocks] float32, block_scores'
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_size: int,
    num_kept: int,  # MsaConfig.num_blocks
    local_blocks: int,
) -> torch.Tensor:  # [num_seqs, num_index_heads, min(num_kept, num_index_blocks)] int32, -1: no block
    """The query's own block and the local_blocks - 1 before it boosted to +inf, then the best num_kept blocks, ties to
    the earlier block (a stable sort, as the reference); a slot past the sequence's blocks (fewer blocks than kept, or
    a padded row) is -1. Static shapes only."""
    num_index_blocks = scores.shape[-1]
    nb = (seq_lens.long() + block_size - 1) // block_size  # [B] the sequence's blocks; its own is nb - 1
    blocks = torch.arange(num_index_blocks, device=scores.device)
    local = (blocks[None, :] < nb[:, None]) & (blocks[None, :] >= (nb - local_blocks)[:, None])  # [B, nb_max]
    scores = scores.masked_fill(local[:, None, :], float("inf")) + 0.0  # -0.0 -> +0.0 (dsa_decode.select_pools)
    kept = min(num_kept, num_index_blocks)
    best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kept]
    return torch.where(best < nb[:, None, None], best, -1).to(torch.int32)


def top_blocks(
    scores: torch.Tensor,  # [num_seqs, num_index_heads, num_index_blocks] float32, block_scores' with local_blocks
    num_kept: int,
) -> torch.Tensor:  # [num_seqs, num_index_heads, min(num_kept, num_index_blocks)] int64
    """select_blocks' choice in one sort: the local blocks come boosted and -0.0 made +0.0 by block_scores, and a block
    past a sequence's end (scored -inf, so listed only after every block it has) is left listed: sparse_decode reads
    no key of it, as of select_blocks' -1."""
    kept = min(num_kept, scores.shape[-1])
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :kept]


@jit
def online_softmax_tile(s, m, l, acc, v, DOT_PRECISION: tl.constexpr):
    """One key tile of the online softmax: logits s [BLOCK_H, BLOCK_N] (log2 domain, masked lanes -inf), values v
    [BLOCK_N, width]; returns the new (max, sum, accumulator). Rows with every key so far masked stay (-inf, 0, 0):
    their max is kept finite for the exponentials, so no NaN (a block list may start with an empty block)."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


@jit
def store_decode_output(
    acc, m, l,  # [BLOCK_H, BLOCK_W] float32, [BLOCK_H], [BLOCK_H]: online_softmax_tile's state
    out_ptr, part_out_ptr, part_lse_ptr,  # as paged_attention.split_partials lays them out
    seq, heads, h_mask, w, w_mask,  # the program's sequence, head rows [BLOCK_H] and output columns [BLOCK_W]
    stride_os, stride_oh, num_heads, width, split,
    NUM_SPLITS: tl.constexpr,
):
    """The normalized output (one split) or the split's partial output and log2 log-sum-exp (paged_attention's merge
    reads them). NOTE: no key (a padded row, an empty split) leaves l == 0: output 0, lse -inf."""
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_mask = h_mask[:, None] & w_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + seq * stride_os + heads[:, None] * stride_oh + w[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + part[:, None] * width + w[None, :], o, mask=o_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=h_mask)


@jit
def _sparse_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    chosen_ptr,  # [num_seqs, num_index_heads, num_kept] int32 / int64; -1 or a block past the end: no key
    out_ptr,  # [num_seqs, num_heads, head_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    stride_qs,
    stride_qh,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    stride_bt,
    stride_xs,  # chosen strides: seq, index head
    stride_xh,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    kv_group,  # query heads per kv head
    index_group,  # query heads per index head
    num_kept,
    scale,
    RUN: tl.constexpr,  # query heads of one program: they share their kv head and their index head
    PAGE_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, run of RUN heads, split): online softmax over the keys j < seq_len of its split's share of the
    chosen blocks (any order: the softmax does not care)."""
    seq = tl.program_id(0).to(tl.int64)
    first = tl.program_id(1) * RUN
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_head = first // kv_group
    index_head = first // index_group
    r = tl.arange(0, BLOCK_H)
    heads = first + r
    h_mask = r < RUN
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    qk_scale = scale * 1.4426950408889634  # log2(e): exp2 below is the cheap exponential
    per_split = tl.cdiv(num_kept, NUM_SPLITS)
    c_start = split * per_split
    c_end = tl.minimum(c_start + per_split, num_kept)
    table = block_tables_ptr + seq * stride_bt
    chosen = chosen_ptr + seq * stride_xs + index_head * stride_xh
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for c in range(c_start, c_end):
        blk = tl.load(chosen + c)
        start = blk * BLOCK_SIZE
        # -1 (no block) gives an empty range; as a tile: a scalar mask term trips the interpreter
        end = tl.zeros([BLOCK_N], dtype=tl.int32) + tl.where(blk >= 0, tl.minimum(start + BLOCK_SIZE, seq_len), 0)
        for n0 in range(0, BLOCK_SIZE, BLOCK_N):
            pos = start + n0 + tl.arange(0, BLOCK_N)
            k_mask = (pos < end) & (pos >= 0)
            page = tl.load(table + pos // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
            row = page * stride_cp + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
            kv_mask = k_mask[:, None] & d_mask[None, :]
            k = tl.load(k_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_H, BLOCK_N]
            s = tl.where(k_mask[None, :], s, float("-inf"))
            v = tl.load(v_cache_ptr + row[:, None] + d[None, :], mask=kv_mask, other=0.0)
            m, l, acc = online_softmax_tile(s, m, l, acc, v, DOT_PRECISION)
    store_decode_output(acc, m, l, out_ptr, part_out_ptr, part_lse_ptr, seq, heads, h_mask, d, d_mask, stride_os,
                        stride_oh, num_heads, head_dim, split, NUM_SPLITS)


def sparse_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    chosen: torch.Tensor,  # [num_seqs, num_index_heads, num_kept] int32 or int64: select_blocks' or top_blocks'
    block_size: int,
    scale: float,
    num_splits: int = 1,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim] in the cache's dtype (the model's)
    """Query head h reads the blocks its index head h // (num_heads / num_index_heads) chose, keys j < seq_len; float32
    softmax and accumulation. num_splits (along the chosen blocks) is a launch constant, so a graph stays valid."""
    require_triton()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, num_index_heads, num_kept = kv_cache.shape[3], chosen.shape[1], chosen.shape[2]
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2 and kv_cache.shape[4] == head_dim, tuple(kv_cache.shape)
    assert num_heads % num_kv_heads == 0 and num_heads % num_index_heads == 0
    assert chosen.shape[0] == num_seqs and chosen.dtype in (torch.int32, torch.int64) and chosen.stride(2) == 1
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32 and num_splits >= 1
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    q = q.to(kv_cache.dtype)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    kv_group, index_group = num_heads // num_kv_heads, num_heads // num_index_heads
    run = math.gcd(kv_group, index_group)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    part_out, part_lse = split_partials(out, num_splits)
    _sparse_decode_kernel[(num_seqs, num_heads // run, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, chosen, out, part_out, part_lse,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        chosen.stride(0), chosen.stride(1), out.stride(0), out.stride(1), num_heads, head_dim, kv_group, index_group,
        num_kept, scale,
        RUN=run, PAGE_SIZE=kv_cache.shape[2], BLOCK_SIZE=block_size, NUM_SPLITS=num_splits,
        BLOCK_H=max(16, next_power_of_2(run)), BLOCK_N=max(16, min(64, next_power_of_2(block_size))),
        BLOCK_D=max(16, next_power_of_2(head_dim)), DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
        num_stages=2,
    )
    merge_splits(part_out, part_lse, out, num_splits, False)
    return out


def sparse_num_splits(num_kept: int, block_size: int) -> int:
    """Splits along the chosen blocks: about 512 keys each, at most 16, from the config alone (eager and graphed
    decode then round alike whatever the batch)."""
    return max(1, min(num_kept, 16, cdiv(num_kept * block_size, 512)))


def block_scores_ref(q, index_cache, block_tables, seq_lens, block_size) -> torch.Tensor:
    """block_scores per sequence in torch (float32 products): [num_seqs, Ni, num_index_blocks], -inf past the end."""
    page_size = index_cache.shape[2]
    num_blocks = cdiv(block_tables.shape[1] * page_size, block_size)
    out = torch.full((q.shape[0], q.shape[1], num_blocks), float("-inf"), device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        keys = index_cache[0, block_tables[i, : cdiv(seq_len, page_size)].long()].flatten(0, 1)[:seq_len]
        s = q[i].float() @ keys.float().t()  # [Ni, S]
        s = torch.nn.functional.pad(s, (0, cdiv(seq_len, block_size) * block_size - seq_len), value=float("-inf"))
        out[i, :, : cdiv(seq_len, block_size)] = s.view(q.shape[1], -1, block_size).amax(dim=-1)
    return out


def sparse_decode_ref(q, kv_cache, block_tables, seq_lens, chosen, block_size, scale) -> torch.Tensor:
    """sparse_decode per sequence in float32 (the truth): softmax over the chosen blocks' keys j < seq_len."""
    page_size, num_heads = kv_cache.shape[2], q.shape[1]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pages = block_tables[i, : cdiv(seq_len, page_size)].long()
        keys, values = (kv_cache[j, pages].flatten(0, 1)[:seq_len].float() for j in (0, 1))  # [S, Nkv, D]
        kept = torch.zeros(chosen.shape[1], seq_len + block_size, dtype=torch.bool, device=q.device)
        for h, row in enumerate(chosen[i].tolist()):
            for b in (b for b in row if b >= 0):
                kept[h, b * block_size : (b + 1) * block_size] = True
        heads = kept[:, :seq_len].repeat_interleave(num_heads // chosen.shape[1], dim=0)  # [Nq, S]
        kv_heads = torch.arange(num_heads, device=q.device) // (num_heads // kv_cache.shape[3])
        s = torch.einsum("hd,shd->hs", q[i].float(), keys[:, kv_heads]) * scale
        probs = torch.softmax(s.masked_fill(~heads, float("-inf")), dim=-1)
        out[i] = torch.einsum("hs,shd->hd", probs, values[:, kv_heads]).to(q.dtype)
    return out
