"""Decode attention over the paged KV cache (one query token per sequence), split along the sequence.

Flash-decoding: program (seq, kv_head, split) attends all query heads of one GQA group to one contiguous
range of keys and writes a partial output with its log-sum-exp; a second kernel merges the splits. With
num_splits == 1 the first kernel writes the output directly. Keys are gathered token by token through the
block table (slot = block_tables[seq, pos // page_size] * page_size + pos % page_size), so any page size
works. Semantics are helios.layers.attention's: scale, then soft-cap, then mask; a sliding window lets a
query at position p see keys p - window < k <= p. `paged_attention_ref` is the torch reference of the
decode and the prefill kernel alike. Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    tanh,
    tl,
    use_pdl,
)


@jit
def _scores(
    q,  # [BLOCK_H, BLOCK_D]
    k,  # [BLOCK_N, BLOCK_D]
    scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Logits in the log2 domain: (cap * tanh(s * scale / cap) or s * scale) * log2(e); [BLOCK_H, BLOCK_N]."""
    return _scaled(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), scale, softcap, HAS_SOFTCAP)


@jit
def _scaled(s, scale, softcap, HAS_SOFTCAP: tl.constexpr):
    """Raw q.k products -> logits in the log2 domain (see _scores)."""
    if HAS_SOFTCAP:
        y = s * (scale / softcap)
        s = softcap * tanh(y)
        s = s * 1.4426950408889634  # log2(e): exp2 below is the cheap exponential
    else:
        s = s * (scale * 1.4426950408889634)
    return s


@jit
def _sink_start(sinks_ptr, heads, rows, m, l):
    """The online softmax's start with a sink logit (log2 domain) in `rows`: max = the sink, sum = 2^0 = 1, and
    an accumulator of 0 (the sink's value); other rows keep (m, l)."""
    sink = tl.load(sinks_ptr + heads, mask=rows, other=0.0).to(tl.float32) * 1.4426950408889634
    return tl.where(rows, sink, m), tl.where(rows, 1.0, l)


@jit
def _decode_kernel(
    q_ptr,  # [num_seqs, num_heads, head_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    block_tables_ptr,  # [num_seqs, max_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    out_ptr,  # [num_seqs, num_heads, out_dim], written when NUM_SPLITS == 1
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32, written when NUM_SPLITS > 1
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    sinks_ptr,  # [num_heads] sink logits, read when HAS_SINKS
    stride_qs,
    stride_qh,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    stride_bt,
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    out_dim,  # the values' columns (<= head_dim: the cache's past them are zeros, neither read nor written out)
    scale,
    softcap,
    window,
    GROUP: tl.constexpr,  # query heads per kv head
    PAGE_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # NOTE: seq_lens and the block table are read before pdl_wait: the graph writes them before its first
    # layer, and under PDL a kernel starts only once the one before it has passed its own wait, so whatever
    # the kernel two back wrote is complete. The query and the newest key (the kernel just before) are not.
    seq_len = tl.load(seq_lens_ptr + seq)
    lo = 0
    if HAS_WINDOW:
        lo = tl.maximum(seq_len - window, 0)  # the query sits at seq_len - 1
    # a split covers whole BLOCK_N blocks; trailing splits of a short sequence are empty
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    offs_n = tl.arange(0, BLOCK_N)
    table = block_tables_ptr + seq * stride_bt
    # block ids of the first two key blocks: the loop below keeps one block's keys and the next block's ids
    # in flight while it computes, so a step costs one memory round trip rather than three
    pos = start + offs_n
    block = tl.load(table + pos // PAGE_SIZE, mask=pos < end, other=0).to(tl.int64)
    pos_next = pos + BLOCK_N
    block_next = tl.load(table + pos_next // PAGE_SIZE, mask=pos_next < end, other=0).to(tl.int64)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)

    h = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + h
    h_mask = h < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    q = tl.load(
        q_ptr + seq * stride_qs + heads[:, None] * stride_qh + d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    v_cols = d < out_dim
    kv_mask = (pos < end)[:, None] & d_mask[None, :]
    offset = block * stride_cp + (pos % PAGE_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=kv_mask & v_cols[None, :], other=0.0)
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_SINKS:  # the sink is one more logit of split 0, with value 0: the running max starts there
        m, l = _sink_start(sinks_ptr, heads, h_mask & (h * 0 + split == 0), m, l)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start_n in range(start, end, BLOCK_N):
        k_mask = start_n + offs_n < end
        # the next block's keys and values, and the ids of the block after it, load while this one computes
        pos_next = start_n + BLOCK_N + offs_n
        next_mask = (pos_next < end)[:, None] & d_mask[None, :]
        offset = block_next * stride_cp + (pos_next % PAGE_SIZE) * stride_cs + kv_head * stride_ch
        k_next = tl.load(k_cache_ptr + offset[:, None] + d[None, :], mask=next_mask, other=0.0)
        v_next = tl.load(v_cache_ptr + offset[:, None] + d[None, :], mask=next_mask & v_cols[None, :], other=0.0)
        pos_after = pos_next + BLOCK_N
        block_next = tl.load(table + pos_after // PAGE_SIZE, mask=pos_after < end, other=0).to(tl.int64)
        s = _scores(q, k, scale, softcap, HAS_SOFTCAP, DOT_PRECISION)
        s = tl.where(k_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
        k = k_next
        v = v_next

    # NOTE: an empty range (an empty split, or a padded row with seq_len 0) leaves l == 0: output 0, lse -inf.
    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(
            out_ptr + seq * stride_os + heads[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=h_mask[:, None] & v_cols[None, :],
        )
    else:
        row = (seq * num_heads + heads) * NUM_SPLITS + split  # [BLOCK_H]
        tl.store(part_out_ptr + row[:, None] * head_dim + d[None, :], o, mask=h_mask[:, None] & d_mask[None, :])
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + row, lse, mask=h_mask)


@jit
def _decode_reduce_kernel(
    part_out_ptr,  # [num_seqs, num_heads, NUM_SPLITS, head_dim] float32
    part_lse_ptr,  # [num_seqs, num_heads, NUM_SPLITS] float32, log2 domain
    out_ptr,  # [num_seqs, num_heads, out_dim]
    stride_os,
    stride_oh,
    num_heads,
    head_dim,
    out_dim,  # out's columns: the partials' first out_dim
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    splits = tl.arange(0, BLOCK_S)
    s_mask = splits < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_mask = d < head_dim
    row = (seq * num_heads + head) * NUM_SPLITS + splits  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))
    g = tl.max(lse, axis=0)
    g = tl.where(g == float("-inf"), 0.0, g)
    w = tl.exp2(lse - g)  # [BLOCK_S]; 0 for empty splits
    o = tl.load(part_out_ptr + row[:, None] * head_dim + d[None, :], mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    num = tl.sum(w[:, None] * o, axis=0)
    den = tl.sum(w, axis=0)
    res = num / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + seq * stride_os + head * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d < out_dim)


def check_paged_inputs(q, kv_cache, block_tables, seq_lens, num_seqs: int) -> tuple[int, int, int]:
    """Shared launcher asserts; returns (num_kv_heads, page_size, group)."""
    assert q.dim() == 3, f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_pages, page_size, Nkv, D]"
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    assert q.shape[2] == head_dim, f"q head_dim {q.shape[2]} != cache head_dim {head_dim}"
    assert q.shape[1] % num_kv_heads == 0, f"num_heads {q.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
    assert q.dtype == kv_cache.dtype, f"q {q.dtype} and kv_cache {kv_cache.dtype} must share a dtype"
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block_tables rows must be contiguous"
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("kv_cache", kv_cache)
    return num_kv_heads, page_size, q.shape[1] // num_kv_heads


def check_sinks(sinks: torch.Tensor | None, num_heads: int) -> None:
    assert sinks is None or (sinks.shape == (num_heads,) and sinks.is_contiguous()), "sinks must be [num_heads]"


def dot_precision(dtype: torch.dtype) -> str:
    # NOTE: float32 is a test/debug dtype here: keep it exact rather than TF32 (ignored for 16-bit inputs).
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention(
    q: torch.Tensor,  # [num_seqs, num_heads, head_dim], one query token per sequence
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, keys per sequence including this token's
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    num_splits: int = 1,
    out: torch.Tensor | None = None,  # [num_seqs, num_heads, out_dim]
    block_n: int | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits
    out_dim: int | None = None,  # the values' leading columns (mimo_v2_flash's v heads); None: head_dim
) -> torch.Tensor:  # [num_seqs, num_heads, out_dim]
    """num_splits is a launch constant (not read from seq_lens), so a captured CUDA graph stays valid. out_dim <
    head_dim: the cache's values are zero past out_dim (reshape_and_cache pads a narrow v): those columns are
    neither read nor written, and the output is [.., out_dim] (no slice copy before the o projection)."""
    require_triton()
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size, group = check_paged_inputs(q, kv_cache, block_tables, seq_lens, num_seqs)
    assert num_splits >= 1
    out_dim = out_dim or head_dim
    assert out_dim <= head_dim
    out = q.new_empty(num_seqs, num_heads, out_dim) if out is None else out
    assert out.shape == (num_seqs, num_heads, out_dim) and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    block_d = max(16, next_power_of_2(head_dim))
    block_n = block_n or (64 if block_d <= 128 else 32)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    pdl = use_pdl(q, num_seqs)
    part_out, part_lse = split_partials(out, num_splits, head_dim)
    check_sinks(sinks, num_heads)
    _decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_out,
        part_lse,
        out if sinks is None else sinks,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        num_heads,
        head_dim,
        out_dim,
        scale,
        softcap or 1.0,
        sliding_window or 0,
        GROUP=group,
        PAGE_SIZE=page_size,
        NUM_SPLITS=num_splits,
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None,
        BLOCK_H=max(16, next_power_of_2(group)),  # tl.dot needs M >= 16
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        USE_PDL=pdl,
        num_warps=4,
        num_stages=2,
        launch_pdl=pdl,
    )
    merge_splits(part_out, part_lse, out, num_splits, pdl)
    return out


def split_partials(out: torch.Tensor, num_splits: int,
                   head_dim: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial outputs [num_seqs, num_heads, num_splits, head_dim] float32, their log2 log-sum-exps
    [num_seqs, num_heads, num_splits]) of a decode over `num_splits` key ranges into `out` [num_seqs, num_heads,
    out_dim] (head_dim: the partials' width, None: out's); with one split the kernel writes `out` directly and both
    are `out` itself, never written."""
    if num_splits == 1:
        return out, out
    num_seqs, num_heads, out_dim = out.shape
    head_dim = head_dim or out_dim
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=out.device)
    return part_out, torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=out.device)


def merge_splits(
    part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor, num_splits: int, pdl: bool
) -> None:
    """The merge kernel over split_partials' buffers into `out`; nothing with one split."""
    if num_splits == 1:
        return
    num_seqs, num_heads, out_dim = out.shape
    head_dim = part_out.shape[-1]
    _decode_reduce_kernel[(num_seqs, num_heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_heads,
        head_dim,
        out_dim,
        NUM_SPLITS=num_splits,
        BLOCK_S=next_power_of_2(num_splits),
        BLOCK_D=max(16, next_power_of_2(head_dim)),
        USE_PDL=pdl,
        num_warps=4,
        launch_pdl=pdl,
    )


def choose_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int, num_sms: int = 132) -> int:
    """Enough splits to fill the GPU with (seq, kv_head, split) programs, none shorter than 256 keys."""
    if max_seq_len <= 256:
        return 1
    want = cdiv(2 * num_sms, max(1, num_seqs * num_kv_heads))
    return max(1, min(want, cdiv(max_seq_len, 256), 16))


def paged_attention_ref(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,  # [num_heads] sink logits
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of each sequence's last queries over its cached keys, in float32 (the truth); sinks as
    HF's eager attention adds them: one more logit per head in the softmax, dropped after it."""
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    group = q.shape[1] // num_kv_heads
    out = torch.zeros_like(q)
    qsl, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        start, end = qsl[i], qsl[i + 1]
        if end == start or seq_len == 0:
            continue
        num_blocks = cdiv(seq_len, page_size)
        blocks = block_tables[i, :num_blocks].long()
        keys = kv_cache[0, blocks].flatten(0, 1)[:seq_len].float()  # [S, Nkv, D]
        values = kv_cache[1, blocks].flatten(0, 1)[:seq_len].float()
        keys = keys.repeat_interleave(group, dim=1).transpose(0, 1)  # [Nq, S, D]
        values = values.repeat_interleave(group, dim=1).transpose(0, 1)
        qh = q[start:end].float().transpose(0, 1)  # [Nq, Lq, D]
        scores = torch.matmul(qh, keys.transpose(1, 2)) * scale  # [Nq, Lq, S]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        allowed = k_pos <= q_pos
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.matmul(probs, values).transpose(0, 1).to(q.dtype)
    return out


def paged_decode_attention_ref(
    q, kv_cache, block_tables, seq_lens, scale, sliding_window=None, softcap=None, num_splits=1, out=None, block_n=None,
    sinks=None,
):
    """paged_attention_ref with one query per sequence (num_splits and block_n do not change the math)."""
    query_start_loc = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    result = paged_attention_ref(q, kv_cache, query_start_loc, seq_lens, block_tables, scale, sliding_window, softcap,
                                 sinks)
    if out is not None:
        out.copy_(result)
        return out
    return result
