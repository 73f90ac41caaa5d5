"""Compressed-attention decode (deepseek_v4, helios.layers.compressed_attention): CSA's lightning-indexer scores over
the paged compressed entries, the top index_topk choice, and the sink attention over the sliding window's keys plus
the chosen (CSA) or all (HCA) compressed entries, for one query token per sequence with every length and page read
on the device (no host sync, no data-dependent shape: CUDA-graph safe).

As helios.kernels.sparse_decode / dsa_decode do for minimax_m3 / glm5_next: what grows with the context (every
compressed index key for the scores; the entries attended) is read by Triton kernels that stop at each sequence's
complete windows, and the choice between the [B, max entries] float32 scores is the reference's own stable torch sort
(ties to the earlier entry by construction: LightningIndexer.select).

Where an entry lives: window j's entry (its key, d values, then CSA's index key, Di) is spread over the window's last
r rows (CompressedAttentionConfig.entry_rows), all in the page of the window's last token, e values per row: with
the page's rows contiguous (row stride e) the entry's values are contiguous from row (j m + m - r) % page_size of
page table[(j m + m - 1) // page_size]. Imports torch and helios.kernels only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import cdiv, check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.paged_attention import dot_precision, merge_splits, split_partials
from helios.kernels.sparse_decode import online_softmax_tile, store_decode_output


@jit
def _entry_base(table, j, RATE: tl.constexpr, ROWS: tl.constexpr, PAGE_SIZE: tl.constexpr, stride_ep, stride_es,
                mask):
    """Offsets of entries j [BLOCK_N] (their first value) in the entry pages."""
    last = j * RATE + RATE - 1
    page = tl.load(table + last // PAGE_SIZE, mask=mask, other=0).to(tl.int64)
    return page * stride_ep + ((j * RATE + RATE - ROWS) % PAGE_SIZE) * stride_es


@jit
def _index_scores_kernel(
    q_ptr,  # [num_seqs, Ni, Di] rotated index queries
    w_ptr,  # [num_seqs, Ni] head weights, times weight_scale in float32
    entries_ptr,  # [num_pages, page_size, e] entry shares
    block_tables_ptr,  # [num_seqs, max_pages] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, max_entries] float32
    stride_qs,
    stride_qh,
    stride_ws,
    stride_ep,
    stride_es,
    stride_bt,
    stride_os,
    num_heads,
    index_dim,
    key_offset,  # the index key's first value within an entry (head_dim)
    max_entries,
    scale,  # Di^-0.5
    weight_scale,  # 1/sqrt(Ni) where the weights come unscaled (the layer's projection columns), else 1
    RATE: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, tile of entries): sum_h w_h relu(q_h . k_j) Di^-0.5 in float32 for entries j < seq_len // RATE
    (the complete windows a query at seq_len - 1 sees), -inf past them; a -0.0 score written +0.0 (select_entries'
    + 0.0, so one sort chooses: top_entries)."""
    seq = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK_N
    j = start + tl.arange(0, BLOCK_N)
    num_entries = tl.load(seq_lens_ptr + seq) // RATE
    e_mask = j < num_entries
    score = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    if start < num_entries:  # a tile past the sequence's windows (most of a graph bucket's table) reads nothing
        heads = tl.arange(0, BLOCK_H)
        h_mask = heads < num_heads
        d = tl.arange(0, BLOCK_D)
        d_mask = d < index_dim
        q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                    mask=h_mask[:, None] & d_mask[None, :], other=0.0)
        base = _entry_base(block_tables_ptr + seq * stride_bt, j, RATE, ROWS, PAGE_SIZE, stride_ep, stride_es,
                           e_mask)
        k = tl.load(entries_ptr + base[:, None] + key_offset + d[None, :], mask=e_mask[:, None] & d_mask[None, :],
                    other=0.0)
        s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), 0.0) * scale  # [BLOCK_H, BLOCK_N]
        w = tl.load(w_ptr + seq * stride_ws + heads, mask=h_mask, other=0.0).to(tl.float32) * weight_scale
        score = tl.sum(s * w[:, None], axis=0)
        score = tl.where(e_mask, tl.where(score == 0.0, 0.0, score), float("-inf"))
    tl.store(out_ptr + seq * stride_os + j, score, mask=j < max_entries)


def index_scores(
    q: torch.Tensor,  # [num_seqs, Ni, Di] rotated index queries
    weights: torch.Tensor,  # [num_seqs, Ni] float32, or any float dtype with weight_scale (any row stride)
    entries: torch.Tensor,  # [1, num_pages, page_size, e] the layer's entry shares
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32 (group 0's)
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rate: int,  # csa_rate
    rows: int,  # entry_rows
    key_offset: int,  # head_dim: the index key follows the entry's key
    weight_scale: float = 1.0,  # each weight times this in float32 (the layer's weights.float() * Ni^-0.5)
) -> torch.Tensor:  # [num_seqs, max_pages * page_size // rate] float32, -inf past the complete windows
    """Every complete window's index score; the entry count comes from the table's width, never from the lengths (a
    graph's shapes are its bucket's)."""
    require_triton()
    num_seqs, num_heads, index_dim = q.shape
    _check_entries(entries, block_tables, seq_lens, num_seqs)
    assert weights.shape == (num_seqs, num_heads) and weights.is_floating_point() and weights.stride(1) == 1
    check_last_dim_contiguous("q", q)
    page_size = entries.shape[2]
    max_entries = block_tables.shape[1] * page_size // rate
    out = torch.empty(num_seqs, max_entries, dtype=torch.float32, device=q.device)
    if num_seqs == 0 or max_entries == 0:
        return out
    pages = entries[0]
    q = q.to(entries.dtype)  # tl.dot takes one dtype
    block_n = max(16, min(64, next_power_of_2(max_entries)))
    _index_scores_kernel[(num_seqs, cdiv(max_entries, block_n))](
        q, weights, pages, block_tables, seq_lens, out, q.stride(0), q.stride(1), weights.stride(0),
        pages.stride(0), pages.stride(1), block_tables.stride(0), out.stride(0), num_heads, index_dim, key_offset,
        max_entries, index_dim**-0.5, weight_scale, RATE=rate, ROWS=rows, PAGE_SIZE=page_size,
        BLOCK_H=max(16, next_power_of_2(num_heads)), BLOCK_N=block_n, BLOCK_D=max(16, next_power_of_2(index_dim)),
        DOT_PRECISION=dot_precision(q.dtype), num_warps=4,
    )
    return out


def select_entries(
    scores: torch.Tensor,  # [num_seqs, max_entries] float32, index_scores'
    seq_lens: torch.Tensor,  # [num_seqs] int32
    rate: int,
    num_kept: int,  # index_topk
) -> torch.Tensor:  # [num_seqs, min(num_kept, max_entries)] int32, -1: none
    """The best num_kept complete windows, ties to the earlier (a stable sort, as LightningIndexer.select), -1 past the
    sequence's complete windows (fewer than kept, a padded row). Static shapes only.
    NOTE: + 0.0 turns a -0.0 score (a negative head weight times relu's 0) into +0.0 (dsa_decode.select_pools)."""
    num_entries = seq_lens.long() // rate
    kept = min(num_kept, scores.shape[1])
    best = torch.sort(scores + 0.0, dim=-1, descending=True, stable=True).indices[:, :kept]
    return torch.where(best < num_entries[:, None], best, -1).to(torch.int32)


def top_entries(
    scores: torch.Tensor,  # [num_seqs, max_entries] float32, index_scores' (no -0.0)
    num_kept: int,  # index_topk
) -> torch.Tensor:  # [num_seqs, min(num_kept, max_entries)] int64
    """select_entries' choice in one sort (the decode path): an entry past a sequence's complete windows (scored -inf,
    so listed only after every one it has) is left listed, where select_entries writes -1: compressed_decode reads
    neither."""
    kept = min(num_kept, scores.shape[1])
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :kept]


@jit
def _compressed_decode_kernel(
    q_ptr,  # [num_seqs, num_heads, d]
    rows_ptr,  # [num_window_pages, page_size, raw_dim]: a token's key in its first d values
    entries_ptr,  # [num_pages, page_size, e]
    window_tables_ptr,  # [num_seqs, max_pages] int32: the rows' pages
    block_tables_ptr,  # [num_seqs, max_pages] int32: the entries' pages
    seq_lens_ptr,  # [num_seqs] int32
    chosen_ptr,  # [num_seqs, num_listed] int32 / int64 (-1 or past the complete windows: none) when HAS_LIST
    sinks_ptr,  # [num_heads] float32
    out_ptr,  # [num_seqs, num_heads, d], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, d] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    stride_qs,
    stride_qh,
    stride_rp,  # rows strides: page, slot in page
    stride_rs,
    stride_ep,  # entries strides: page, slot in page
    stride_es,
    stride_wt,
    stride_bt,
    stride_cs,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    num_listed,
    window,
    scale,
    RATE: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    HAS_LIST: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Program (seq, head block, split): online softmax over the split's share of the entries; split 0 also takes
    the window's keys and the sink (a logit per head with no value, counted once: in split 0's sum)."""
    seq = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    h_mask = heads < num_heads
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    log2e = 1.4426950408889634  # exp2 below is the cheap exponential
    qk_scale = scale * log2e
    sink = tl.load(sinks_ptr + heads, mask=h_mask, other=0.0).to(tl.float32) * log2e
    first = split == 0
    m = tl.where(first, sink, float("-inf"))
    l = tl.where(first, 1.0, 0.0) + tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    # the window: positions max(0, seq_len - window) .. seq_len - 1, in split 0 only (others: an empty range)
    lo = tl.maximum(seq_len - window, 0)
    hi = tl.where(first, seq_len, lo)
    wtable = window_tables_ptr + seq * stride_wt
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        k_mask = pos < hi
        page = tl.load(wtable + pos // PAGE_SIZE, mask=k_mask, other=0).to(tl.int64)
        row = page * stride_rp + (pos % PAGE_SIZE) * stride_rs
        kv = tl.load(rows_ptr + row[:, None] + d[None, :], mask=k_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(k_mask[None, :], s, float("-inf"))
        m, l, acc = online_softmax_tile(s, m, l, acc, kv, DOT_PRECISION)
    # the entries: the listed ones, or every complete window
    num_entries = seq_len // RATE
    if HAS_LIST:
        count = num_listed
    else:
        count = num_entries
    per_split = tl.cdiv(count, NUM_SPLITS)
    c_start = split * per_split
    c_end = tl.minimum(c_start + per_split, count)
    table = block_tables_ptr + seq * stride_bt
    for c0 in range(c_start, c_end, BLOCK_N):
        c = c0 + tl.arange(0, BLOCK_N)
        c_mask = c < c_end
        if HAS_LIST:
            j = tl.load(chosen_ptr + seq * stride_cs + c, mask=c_mask, other=-1)
        else:
            j = c
        e_mask = c_mask & (j >= 0) & (j < num_entries)
        base = _entry_base(table, tl.where(e_mask, j, 0), RATE, ROWS, PAGE_SIZE, stride_ep, stride_es, e_mask)
        kv = tl.load(entries_ptr + base[:, None] + d[None, :], mask=e_mask[:, None] & d_mask[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kv), input_precision=DOT_PRECISION) * qk_scale
        s = tl.where(e_mask[None, :], s, float("-inf"))
        m, l, acc = online_softmax_tile(s, m, l, acc, kv, DOT_PRECISION)
    store_decode_output(acc, m, l, out_ptr, part_out_ptr, part_lse_ptr, seq, heads, h_mask, d, d_mask, stride_os,
                        stride_oh, num_heads, head_dim, split, NUM_SPLITS)


def compressed_decode(
    q: torch.Tensor,  # [num_seqs, num_heads, d] rotated queries
    rows: torch.Tensor,  # [1, num_window_pages, page_size, raw_dim]: keys (= values) in the first d values
    entries: torch.Tensor,  # [1, num_pages, page_size, e]
    window_tables: torch.Tensor,  # [num_seqs, max_pages] int32 (the window group's, or block_tables)
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, output 0)
    sinks: torch.Tensor,  # [num_heads]
    window: int,
    rate: int,  # 0: a sliding layer (no entries)
    entry_rows: int,
    chosen: torch.Tensor | None = None,  # [num_seqs, K] int32 / int64, select_entries' or top_entries' (CSA); None:
    #                                      every entry (HCA)
    num_splits: int = 1,
    block_h: int = 16,
) -> torch.Tensor:  # [num_seqs, num_heads, d] in the cache's dtype
    """attend_with_sinks for one query at seq_len - 1: its window's keys, then its compressed entries (the chosen
    ones, or all complete windows), K = V, scale d^-0.5, float32 softmax and accumulation. num_splits (along the
    entries) is a launch constant, so a captured graph stays valid."""
    require_triton()
    num_seqs, num_heads, head_dim = q.shape
    if rate == 0:  # a sliding layer: the window alone (an empty list; real tensors stand in for the absent ones)
        entries, rate, entry_rows, chosen = rows, 1, 1, block_tables[:, :0]
    else:
        _check_entries(entries, block_tables, seq_lens, num_seqs)
    assert rows.dim() == 4 and rows.shape[0] == 1 and rows.shape[3] >= head_dim
    assert entries.shape[3] * entry_rows >= head_dim and seq_lens.dtype == torch.int32
    assert window_tables.shape[0] == num_seqs and window_tables.dtype == torch.int32
    assert sinks.shape == (num_heads,) and num_splits >= 1 and block_h >= 16
    if chosen is not None:
        assert chosen.dim() == 2 and chosen.shape[0] == num_seqs and chosen.dtype in (torch.int32, torch.int64)
        assert chosen.stride(1) == 1
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("rows", rows)
    q = q.to(rows.dtype)
    out = torch.empty_like(q)
    if num_seqs == 0:
        return out
    row_pages, entry_pages = rows[0], entries[0]
    sinks = sinks.float().contiguous()
    listed = chosen if chosen is not None else block_tables  # a placeholder pointer: never read without a list
    block_d = max(16, next_power_of_2(head_dim))
    part_out, part_lse = split_partials(out, num_splits)
    _compressed_decode_kernel[(num_seqs, cdiv(num_heads, block_h), num_splits)](
        q, row_pages, entry_pages, window_tables, block_tables, seq_lens, listed, sinks, out, part_out, part_lse,
        q.stride(0), q.stride(1), row_pages.stride(0), row_pages.stride(1), entry_pages.stride(0),
        entry_pages.stride(1), window_tables.stride(0), block_tables.stride(0), listed.stride(0), out.stride(0),
        out.stride(1), num_heads, head_dim, chosen.shape[1] if chosen is not None else 0, window, head_dim**-0.5,
        RATE=rate, ROWS=entry_rows, PAGE_SIZE=rows.shape[2], HAS_LIST=chosen is not None, NUM_SPLITS=num_splits,
        BLOCK_H=block_h, BLOCK_N=16 if block_d > 256 else 32, BLOCK_D=block_d, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=4 if block_d <= 256 else 8, num_stages=2,
    )
    merge_splits(part_out, part_lse, out, num_splits, False)
    return out


def _check_entries(entries, block_tables, seq_lens, num_seqs) -> None:
    """An entry's values are contiguous across its rows only if a page's rows are (row stride = row width)."""
    assert entries.dim() == 4 and entries.shape[0] == 1, tuple(entries.shape)
    assert entries.stride(3) == 1 and entries.stride(2) == entries.shape[3], "entry rows must be contiguous"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32


def compressed_num_splits(num_listed: int | None, window: int) -> int:
    """Splits along the entries, from the config alone (eager and graphed decode then round alike whatever the
    batch): CSA (num_listed = index_topk) about 512 keys each counting the window's, at most 16; HCA (None: every
    complete window, a count that grows with the length) 4."""
    return 4 if num_listed is None else max(1, min(16, cdiv(num_listed + window, 512)))


def entry_values(entries, block_tables, seq_len_row: int, row: int, rate: int, entry_rows: int) -> torch.Tensor:
    """[seq_len // rate, r * e] every complete window's entry values of sequence `row` (the references' gather)."""
    page_size, width = entries.shape[2], entries.shape[3]
    n = seq_len_row // rate
    windows = torch.arange(n, device=entries.device)
    at = (windows * rate + rate - entry_rows)[:, None] + torch.arange(entry_rows, device=entries.device)
    pages = block_tables[row].long()[at // page_size]
    return entries[0, pages, at % page_size].reshape(n, entry_rows * width)


def index_scores_ref(q, weights, entries, block_tables, seq_lens, rate, rows, key_offset) -> torch.Tensor:
    """index_scores per sequence as LightningIndexer.select computes them: [num_seqs, max_entries] float32."""
    index_dim = q.shape[-1]
    max_entries = block_tables.shape[1] * entries.shape[2] // rate
    out = torch.full((q.shape[0], max_entries), float("-inf"), device=q.device)
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys = entry_values(entries, block_tables, seq_len, i, rate, rows)[:, key_offset : key_offset + index_dim]
        s = torch.relu(q[i].float() @ keys.float().t())  # [Ni, n]
        out[i, : keys.shape[0]] = (s * index_dim**-0.5 * weights[i, :, None]).sum(dim=0)
    return out


def compressed_decode_ref(q, rows, entries, window_tables, block_tables, seq_lens, sinks, window, rate, entry_rows,
                          chosen=None) -> torch.Tensor:
    """compressed_decode per sequence in float32 (the truth): softmax with the sink over the window's keys and the
    chosen (or all) complete windows' entries."""
    page_size, d = rows.shape[2], q.shape[-1]
    out = torch.zeros_like(q)
    for i, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        pos = torch.arange(max(0, seq_len - window), seq_len, device=q.device)
        keys = [rows[0, window_tables[i].long()[pos // page_size], pos % page_size, :d]]
        compressed = entry_values(entries, block_tables, seq_len, i, rate, entry_rows)[:, :d] if rate else keys[0][:0]
        if chosen is not None:
            compressed = compressed[[j for j in chosen[i].tolist() if j >= 0]]
        keys = torch.cat(keys + [compressed]).float()  # [K, d]
        logits = q[i].float() @ keys.t() * d**-0.5  # [Nh, K]
        combined = torch.cat([logits, sinks.float()[:, None]], dim=-1)
        out[i] = (torch.softmax(combined, dim=-1)[:, :-1] @ keys).to(q.dtype)
    return out
