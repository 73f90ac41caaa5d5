"""deepseek_v4's compressor decode step (helios.layers.compressed_attention.Compressor's entry of one window, and its
write) in one launch per compressor: for each sequence whose token at position p completes window j = p // rate
((p + 1) % rate == 0, a real row), the entry mixed from the window's raw rows (with overlap: window j - 1's first
halves too, none for window 0), as Compressor._mix computes it (softmax of gate + position bias over the places per
channel in float32, the mix in the rows' dtype, the RMSNorm multiplied in float32, the interleaved rope at j * rate),
written at its column of the window's entry span (helios.kernels.csa_decode: the last entry_rows rows of the window,
in the page of its last token). Rows that complete no window write nothing; lengths, positions and tables are read on
the device (CUDA-graph safe). Imports torch and helios.kernels only.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, next_power_of_2, require_triton, round_to, tl
from helios.kernels.interleaved_rope import turn_pairs


@jit
def _gate_tile(rows_ptr, bias_ptr, row, shift, places, pairs, mask, gate_col, stride_b, PLACES: tl.constexpr,
               ROUND_GATE: tl.constexpr, ODD: tl.constexpr):
    """gate + position bias of a tile of places [BLOCK_M, BLOCK_P] (evens or odds), -inf masked; rounded to the rows'
    dtype when the bias has it (torch's sum's dtype), else float32."""
    cols = 2 * pairs[None, :] + shift[:, None] + ODD
    g = tl.load(rows_ptr + row[:, None] + gate_col + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + (places % PLACES)[:, None] * stride_b + cols, mask=mask, other=0.0).to(tl.float32)
    s = g + b
    if ROUND_GATE:
        s = round_to(s, rows_ptr.dtype.element_ty)
    return tl.where(mask, s, float("-inf"))


@jit
def _place_tile(rows_ptr, bias_ptr, wtable, q0, j, pairs, pair_mask, gate_col, out_dim, stride_rp, stride_rs, stride_b,
                RATE: tl.constexpr, LEAD: tl.constexpr, PAGE_SIZE: tl.constexpr, ROUND_GATE: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """Places q0 .. q0 + BLOCK_M of window j's mix (with LEAD: window j - 1's places first, their first halves, then
    window j's second halves; none before position 0): (row offsets [BLOCK_M], column shifts [BLOCK_M], mask
    [BLOCK_M, BLOCK_P], gate + bias of the even and the odd channels [BLOCK_M, BLOCK_P])."""
    places = q0 + tl.arange(0, BLOCK_M)
    pos = (j - LEAD) * RATE + places
    valid = (places < (1 + LEAD) * RATE) & (pos >= 0)
    shift = tl.where(places >= LEAD * RATE, out_dim * LEAD, 0)
    page = tl.load(wtable + tl.where(valid, pos, 0) // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    row = page * stride_rp + (pos % PAGE_SIZE) * stride_rs
    mask = valid[:, None] & pair_mask[None, :]
    g_e = _gate_tile(rows_ptr, bias_ptr, row, shift, places, pairs, mask, gate_col, stride_b, RATE, ROUND_GATE, 0)
    g_o = _gate_tile(rows_ptr, bias_ptr, row, shift, places, pairs, mask, gate_col, stride_b, RATE, ROUND_GATE, 1)
    return row, shift, mask, g_e, g_o


@jit
def _compress_one(
    seq,
    rows_ptr,  # [num_window_pages, page_size, raw_dim] raw rows (kv and gate columns at kv_col, kv_col + width)
    window_tables_ptr,  # [num_seqs, max_pages] int32: the rows' pages
    block_tables_ptr,  # [num_seqs, max_pages] int32: the entries' pages
    positions_ptr,  # [num_seqs] int64
    seq_lens_ptr,  # [num_seqs] int32 (0: a padded row)
    cos_ptr,  # [rows, rope_dim / 2]: a table's rows (TABLE: row j * rate) or one per sequence
    sin_ptr,
    entries_ptr,  # [num_pages, page_size, e]
    stride_rp,
    stride_rs,
    stride_wt,
    stride_bt,
    stride_cos,
    stride_sin,
    stride_ep,
    stride_es,
    pad_end,
    bias_ptr,  # [rate, width] position bias
    weight_ptr,  # [out_dim] the norm's weight
    stride_b,
    kv_col,
    out_col,  # the entry's first value in the window's entry span
    out_dim,
    nope_pairs,
    pad_start,  # zeros over [pad_start, pad_end) of the span (the padding past the entry), when PAD
    eps,
    RATE: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    OVERLAP: tl.constexpr,
    TABLE: tl.constexpr,
    ROUND_GATE: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One compressor's entry for sequence seq, if its token completes a window."""
    p = tl.load(positions_ptr + seq).to(tl.int64)
    j = p // RATE
    if ((p + 1) % RATE == 0) & (tl.load(seq_lens_ptr + seq) > 0):
        DT: tl.constexpr = rows_ptr.dtype.element_ty
        LEAD: tl.constexpr = 1 if OVERLAP else 0
        NUM_PLACES: tl.constexpr = (1 + LEAD) * RATE
        gate_col = kv_col + (1 + LEAD) * out_dim
        pairs = tl.arange(0, BLOCK_P)
        pair_mask = pairs < out_dim // 2
        wtable = window_tables_ptr + seq * stride_wt
        # pass 1: each channel's max over the places; pass 2: its sum of exponentials; pass 3: the mix
        max_e = tl.full([BLOCK_P], float("-inf"), tl.float32)
        max_o = tl.full([BLOCK_P], float("-inf"), tl.float32)
        for q0 in range(0, NUM_PLACES, BLOCK_M):
            row, shift, mask, g_e, g_o = _place_tile(rows_ptr, bias_ptr, wtable, q0, j, pairs, pair_mask, gate_col,
                                                     out_dim, stride_rp, stride_rs, stride_b, RATE, LEAD, PAGE_SIZE,
                                                     ROUND_GATE, BLOCK_M)
            max_e = tl.maximum(max_e, tl.max(g_e, axis=0))
            max_o = tl.maximum(max_o, tl.max(g_o, axis=0))
        sum_e = tl.zeros([BLOCK_P], tl.float32)
        sum_o = tl.zeros([BLOCK_P], tl.float32)
        for q0 in range(0, NUM_PLACES, BLOCK_M):
            row, shift, mask, g_e, g_o = _place_tile(rows_ptr, bias_ptr, wtable, q0, j, pairs, pair_mask, gate_col,
                                                     out_dim, stride_rp, stride_rs, stride_b, RATE, LEAD, PAGE_SIZE,
                                                     ROUND_GATE, BLOCK_M)
            sum_e += tl.sum(tl.exp(g_e - max_e[None, :]), axis=0)
            sum_o += tl.sum(tl.exp(g_o - max_o[None, :]), axis=0)
        acc_e = tl.zeros([BLOCK_P], tl.float32)
        acc_o = tl.zeros([BLOCK_P], tl.float32)
        for q0 in range(0, NUM_PLACES, BLOCK_M):
            row, shift, mask, g_e, g_o = _place_tile(rows_ptr, bias_ptr, wtable, q0, j, pairs, pair_mask, gate_col,
                                                     out_dim, stride_rp, stride_rs, stride_b, RATE, LEAD, PAGE_SIZE,
                                                     ROUND_GATE, BLOCK_M)
            w_e = round_to(tl.exp(g_e - max_e[None, :]) / sum_e[None, :], DT)  # the softmax, rounded to the rows'
            w_o = round_to(tl.exp(g_o - max_o[None, :]) / sum_o[None, :], DT)
            cols = 2 * pairs[None, :] + shift[:, None]
            kv_e = tl.load(rows_ptr + row[:, None] + kv_col + cols, mask=mask, other=0.0).to(tl.float32)
            kv_o = tl.load(rows_ptr + row[:, None] + kv_col + cols + 1, mask=mask, other=0.0).to(tl.float32)
            acc_e += tl.sum(round_to(kv_e * w_e, DT), axis=0)  # each product in the rows' dtype, summed in float32
            acc_o += tl.sum(round_to(kv_o * w_o, DT), axis=0)
        mixed_e, mixed_o = round_to(acc_e, DT), round_to(acc_o, DT)
        inv = tl.rsqrt(tl.sum(mixed_e * mixed_e + mixed_o * mixed_o, axis=0) / out_dim + eps)
        nw_e = tl.load(weight_ptr + 2 * pairs, mask=pair_mask, other=0.0).to(tl.float32)
        nw_o = tl.load(weight_ptr + 2 * pairs + 1, mask=pair_mask, other=0.0).to(tl.float32)
        normed_e = round_to(mixed_e * inv * nw_e, DT)  # rms_norm multiplied in float32
        normed_o = round_to(mixed_o * inv * nw_o, DT)
        rope_row = j * RATE if TABLE else seq
        out_e, out_o = turn_pairs(normed_e, normed_o, cos_ptr + rope_row * stride_cos, sin_ptr + rope_row * stride_sin,
                                  pairs, nope_pairs, pair_mask, False)
        # the window's entry span: its last ROWS rows, in the page of its last token (csa_decode._entry_base)
        page = tl.load(block_tables_ptr + seq * stride_bt + (j * RATE + RATE - 1) // PAGE_SIZE).to(tl.int64)
        span = entries_ptr + page * stride_ep + ((j * RATE + RATE - ROWS) % PAGE_SIZE) * stride_es
        ET: tl.constexpr = entries_ptr.dtype.element_ty
        tl.store(span + out_col + 2 * pairs, round_to(out_e, ET).to(ET), mask=pair_mask)
        tl.store(span + out_col + 2 * pairs + 1, round_to(out_o, ET).to(ET), mask=pair_mask)
        if PAD:
            for c0 in range(pad_start, pad_end, 2 * BLOCK_P):
                cols = c0 + tl.arange(0, 2 * BLOCK_P)
                tl.store(span + cols, tl.zeros([2 * BLOCK_P], tl.float32).to(ET), mask=cols < pad_end)


@jit
def _compress_step_kernel(
    rows_ptr, window_tables_ptr, block_tables_ptr, positions_ptr, seq_lens_ptr, cos_ptr, sin_ptr, entries_ptr,
    stride_rp, stride_rs, stride_wt, stride_bt, stride_cos, stride_sin, stride_ep, stride_es, pad_end,
    bias_ptr, weight_ptr, stride_b, kv_col, out_col, out_dim, nope_pairs, pad_start, eps,  # the first compressor's
    bias2_ptr, weight2_ptr, stride_b2, kv_col2, out_col2, out_dim2, nope_pairs2, pad_start2, eps2,  # the second's
    RATE: tl.constexpr,
    ROWS: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    OVERLAP: tl.constexpr,
    TABLE: tl.constexpr,
    ROUND_GATE: tl.constexpr,
    PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_P: tl.constexpr,
    SECOND: tl.constexpr,  # a second compressor (CSA's indexer) in the same launch: program axis 1
    ROUND_GATE2: tl.constexpr,
    PAD2: tl.constexpr,
    BLOCK_M2: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        _compress_one(seq, rows_ptr, window_tables_ptr, block_tables_ptr, positions_ptr, seq_lens_ptr, cos_ptr,
                      sin_ptr, entries_ptr, stride_rp, stride_rs, stride_wt, stride_bt, stride_cos, stride_sin,
                      stride_ep, stride_es, pad_end, bias_ptr, weight_ptr, stride_b, kv_col, out_col, out_dim,
                      nope_pairs, pad_start, eps, RATE, ROWS, PAGE_SIZE, OVERLAP, TABLE, ROUND_GATE, PAD, BLOCK_M,
                      BLOCK_P)
    if SECOND:
        if tl.program_id(1) == 1:
            _compress_one(seq, rows_ptr, window_tables_ptr, block_tables_ptr, positions_ptr, seq_lens_ptr, cos_ptr,
                          sin_ptr, entries_ptr, stride_rp, stride_rs, stride_wt, stride_bt, stride_cos, stride_sin,
                          stride_ep, stride_es, pad_end, bias2_ptr, weight2_ptr, stride_b2, kv_col2, out_col2,
                          out_dim2, nope_pairs2, pad_start2, eps2, RATE, ROWS, PAGE_SIZE, OVERLAP, TABLE, ROUND_GATE2,
                          PAD2, BLOCK_M2, BLOCK_P2)


class Compressed(NamedTuple):
    """One compressor of a layer, as compress_step reads it."""

    position_bias: torch.Tensor  # [rate, width]: width = out_dim, or 2 out_dim with overlap
    norm_weight: torch.Tensor  # [out_dim]
    kv_col: int  # its kv columns in a raw row (its gate's follow, width apart)
    out_col: int  # the entry's column in the window's entry span (0; CSA's indexer key: head_dim)
    eps: float


def compress_step(
    rows: torch.Tensor,  # [1, num_window_pages, page_size, raw_dim] raw rows, this step's already written
    entries: torch.Tensor,  # [1, num_pages, page_size, e] entry shares, written in place
    window_tables: torch.Tensor,  # [num_seqs, max_pages] int32 (the window group's, or block_tables)
    block_tables: torch.Tensor,  # [num_seqs, max_pages] int32
    positions: torch.Tensor,  # [num_seqs] int64: each sequence's one token this step
    seq_lens: torch.Tensor,  # [num_seqs] int32 (0: a padded row, nothing written)
    cos: torch.Tensor,  # [rows, rope_dim / 2] in the rows' dtype: a table's (table=True, row j * rate) or one per seq
    sin: torch.Tensor,
    compressors: list[Compressed],  # the layer's, one or two (CSA: the attention's, then the indexer's)
    *,
    table: bool,
    rate: int,
    entry_rows: int,
    overlap: bool,
    pad_from: int | None = None,  # zero the span from here on (the layer's entry_dim), with the last compressor
    block_m: int | None = None,  # places a tile holds (tests: several tiles); None: from the widths
) -> None:
    """The entries of every window a sequence's token completes (Compressor.forward's for that window), written over
    its entry rows: every compressor of the layer in one launch."""
    require_triton()
    num_seqs = positions.shape[0]
    assert rows.dim() == 4 and rows.shape[0] == 1 and entries.dim() == 4 and entries.shape[0] == 1
    assert entries.stride(3) == 1 and entries.stride(2) == entries.shape[3], "entry rows must be contiguous"
    assert window_tables.shape[0] == num_seqs and block_tables.shape[0] == num_seqs and seq_lens.shape == (num_seqs,)
    assert positions.dtype == torch.int64 and seq_lens.dtype == torch.int32 and len(compressors) in (1, 2)
    assert cos.shape == sin.shape and cos.stride(1) == 1 and sin.stride(1) == 1
    assert table or cos.shape[0] == num_seqs
    check_last_dim_contiguous("rows", rows)
    if num_seqs == 0:
        return
    span = entry_rows * entries.shape[3]
    num_places = (2 if overlap else 1) * rate
    args, constants = [], []
    for i, c in enumerate(compressors):
        width, out_dim = c.position_bias.shape[1], c.norm_weight.shape[0]
        assert width == (2 if overlap else 1) * out_dim and c.position_bias.shape[0] == rate and out_dim % 2 == 0
        assert c.position_bias.dtype in (rows.dtype, torch.float32) and c.position_bias.stride(1) == 1
        assert 2 * cos.shape[1] <= out_dim
        pad = i == len(compressors) - 1 and pad_from is not None and pad_from < span
        block_p = next_power_of_2(out_dim // 2)
        args += [c.position_bias, c.norm_weight.contiguous(), c.position_bias.stride(0), c.kv_col, c.out_col,
                 out_dim, out_dim // 2 - cos.shape[1], pad_from if pad else 0, c.eps]
        constants.append(dict(ROUND_GATE=c.position_bias.dtype == rows.dtype, PAD=pad, BLOCK_P=block_p,
                              BLOCK_M=block_m or min(next_power_of_2(num_places), max(1, 2048 // block_p))))
    second = len(compressors) == 2
    if not second:  # placeholders, never read
        args, constants = args + args, constants + constants
    row_pages, entry_pages = rows[0], entries[0]
    _compress_step_kernel[(num_seqs, len(compressors))](
        row_pages, window_tables, block_tables, positions, seq_lens, cos, sin, entry_pages, row_pages.stride(0),
        row_pages.stride(1), window_tables.stride(0), block_tables.stride(0), cos.stride(0), sin.stride(0),
        entry_pages.stride(0), entry_pages.stride(1), span, *args, RATE=rate, ROWS=entry_rows, PAGE_SIZE=rows.shape[2],
        OVERLAP=overlap, TABLE=table, SECOND=second, **constants[0], **{k + "2": v for k, v in constants[1].items()},
        num_warps=4,
    )


def compress_step_ref(rows, entries, window_tables, block_tables, positions, seq_lens, cos, sin, compressors, *,
                      table, rate, entry_rows, overlap, pad_from=None) -> None:
    """compress_step per sequence and compressor in torch, with Compressor._mix's ops
    (helios.layers.compressed_attention)."""
    page_size, m = rows.shape[2], rate
    for c in compressors:
        width, d = c.position_bias.shape[1], c.norm_weight.shape[0]

        def window_rows(i: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:  # (kv, gate + bias) [m, width]
            pos = torch.arange(window * m, window * m + m, device=rows.device)
            raw = rows[0, window_tables[i].long()[pos // page_size], pos % page_size]
            return raw[:, c.kv_col : c.kv_col + width], raw[:, c.kv_col + width : c.kv_col + 2 * width] + \
                c.position_bias

        for i, (p, n) in enumerate(zip(positions.tolist(), seq_lens.tolist())):
            if n == 0 or (p + 1) % m:
                continue
            j = p // m
            kv, gate = window_rows(i, j)
            if overlap:  # window j's second halves, after window j - 1's first halves (none for window 0)
                kv, gate = kv[:, d:], gate[:, d:]
                if j > 0:
                    prev_kv, prev_gate = window_rows(i, j - 1)
                    kv, gate = torch.cat([prev_kv[:, :d], kv]), torch.cat([prev_gate[:, :d], gate])
            mixed = (kv * gate.softmax(dim=0, dtype=torch.float32).to(kv.dtype)).sum(dim=0)
            h = mixed.float() * torch.rsqrt(mixed.float().pow(2).mean() + c.eps)
            normed = (h * c.norm_weight.float()).to(mixed.dtype)
            row = j * m if table else i
            cs, sn = cos[row].repeat_interleave(2), sin[row].repeat_interleave(2)
            r = cs.shape[0]
            pairs = normed[-r:].unflatten(0, (-1, 2))
            half = torch.stack((-pairs[:, 1], pairs[:, 0]), dim=-1).flatten()
            turned = torch.cat([normed[:-r], (normed[-r:].float() * cs + half.float() * sn).to(normed.dtype)])
            page = block_tables[i, (j * m + m - 1) // page_size].long()
            start = (j * m + m - entry_rows) % page_size
            span = entries[0, page, start : start + entry_rows].view(-1)  # the window's entry rows, contiguous
            span[c.out_col : c.out_col + d] = turned.to(entries.dtype)
            if pad_from is not None and c is compressors[-1]:
                span[pad_from:] = 0
