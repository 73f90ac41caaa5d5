"""Fused MoE for the GPU path, every step on the device with buffers sized from shapes alone (no host sync, so a
decode step can be captured in a CUDA graph), after vLLM's fused_moe design: `moe_route` (softmax, sigmoid or
sqrtsoftplus scores, score bias, group-limited top-k or given ids (hash routing), renorm, scaling: one launch),
`moe_align` (the (token, slot) entries sorted by expert into BLOCK_M-aligned runs), `expert_outputs` (grouped GEMMs
over the stacked [E, out, in] weights: gate_up with its activation fused, then down; each program reads one expert's
weight tile once for every token of its run) and `moe_combine` (each token's k outputs times their weights, summed
in expert order). Values are rounded to the model dtype where helios.layers.moe's torch loop (and HF's) holds them
(gate_up, act(gate), each weighted product and partial sum): in the interpreter the fused block gives the torch
path's bf16 bits. Imports torch and helios.kernels (_triton, rmsnorm: the next norm a combine may take) only.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    interpret_mode,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tanh,
    tl,
    use_pdl,
)
from helios.kernels.rmsnorm import _normalize, _row_warps

SCORINGS = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}
# the expert GEMM's epilogue: gated activations over [gate | up] rows, relu2 (non-gated), or none (down)
ACTS = {"none": 0, "silu": 1, "gelu_tanh": 2, "relu2": 3}
# moe_align's one-program kernel serves up to this many entries (decode batches); beyond, three launches over
# spans of ALIGN_SPAN entries (count, scan, place: prompt steps) where the torch sort (moe_align_ref) took ~30
# launches a layer, the larger part of a MoE prompt step's host time
ALIGN_KERNEL_MAX_ENTRIES = 4096
ALIGN_SPAN = 512
# entries of a decode-sized batch: gemm_config's 16-row blocks up to here (and shared_slot_serves' limit)
DECODE_ENTRIES = 1024


# --- routing ------------------------------------------------------------------------------------------------


@jit
def _route_kernel(
    logits_ptr,  # [T, E]
    bias_ptr,  # [E] float32 (read with HAS_BIAS)
    given_ptr,  # [T, TOP_K] the experts to take, any integer-valued dtype (read with HAS_IDS: no choice by score)
    weights_ptr,  # [T, TOP_K] out
    ids_ptr,  # [T, TOP_K] int32 out
    num_experts,
    stride_logits,
    renorm_eps,
    scaling,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_IDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    G_POW2: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    route_row(logits_ptr + t * stride_logits, bias_ptr, given_ptr + t * TOP_K, weights_ptr + t * TOP_K,
              ids_ptr + t * TOP_K, num_experts, renorm_eps, scaling, TOP_K, K_POW2, SCORING, HAS_BIAS, HAS_IDS,
              NUM_GROUPS, G_POW2, TOPK_GROUPS, RENORM, BLOCK_E, False)


@jit
def route_row(
    logits_row,  # [E] one token's logits
    bias_ptr,  # [E] float32 (read with HAS_BIAS)
    given_row,  # [TOP_K] (read with HAS_IDS)
    weights_row,  # [TOP_K] out
    ids_row,  # [TOP_K] int32 out
    num_experts,
    renorm_eps,
    scaling,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_IDS: tl.constexpr,
    NUM_GROUPS: tl.constexpr,
    G_POW2: tl.constexpr,
    TOPK_GROUPS: tl.constexpr,
    RENORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    OTHER_SMS: tl.constexpr,  # the logits were written by other programs of this launch: loads bypass L1
):
    """One token's routing (moe_route's program; helios.kernels.router's last program of a row routes with it)."""
    e = tl.arange(0, BLOCK_E)
    valid = e < num_experts
    if OTHER_SMS:
        x = tl.load(logits_row + e, mask=valid, other=0.0, cache_modifier=".cg").to(tl.float32)
    else:
        x = tl.load(logits_row + e, mask=valid, other=0.0).to(tl.float32)
    if SCORING == 0:  # softmax over all experts
        x = tl.where(valid, x, float("-inf"))
        p = tl.exp(x - tl.max(x, axis=0))
        p = tl.where(valid, p, 0.0)
        scores = p / tl.sum(p, axis=0)
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:  # sqrt(softplus): x past 20 as F.softplus; log1p(y) = log(u) * y / (u - 1), u = 1 + y (exact for small y)
        y = tl.exp(x)
        u = 1.0 + y
        log1p = tl.where(u == 1.0, y, tl.log(u) * y / (u - 1.0))
        scores = tl.sqrt(tl.where(x > 20.0, x, log1p))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    if NUM_GROUPS > 1:  # keep the TOPK_GROUPS groups whose two best biased scores sum highest
        group = e // (num_experts // NUM_GROUPS)
        g = tl.arange(0, G_POW2)
        group_scores = tl.full([G_POW2], float("-inf"), tl.float32)
        for i in tl.static_range(NUM_GROUPS):
            v = tl.where(group == i, choice, float("-inf"))
            first = tl.argmax(v, axis=0)
            second = tl.max(tl.where(e == first, float("-inf"), v), axis=0)
            group_scores = tl.where(g == i, tl.max(v, axis=0) + second, group_scores)
        keep = e < 0
        for _ in tl.static_range(TOPK_GROUPS):
            best = tl.argmax(group_scores, axis=0)
            keep = keep | (group == best)
            group_scores = tl.where(g == best, float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    k = tl.arange(0, K_POW2)
    top_weights = tl.zeros([K_POW2], tl.float32)
    top_ids = tl.zeros([K_POW2], tl.int32)
    for i in tl.static_range(TOP_K):
        if HAS_IDS:
            best = tl.load(given_row + i).to(tl.int32)
        else:
            best = tl.argmax(choice, axis=0)
        top_weights = tl.where(k == i, tl.sum(tl.where(e == best, scores, 0.0), axis=0), top_weights)
        top_ids = tl.where(k == i, best, top_ids)
        choice = tl.where(e == best, float("-inf"), choice)
    if RENORM:
        top_weights = top_weights / (tl.sum(top_weights, axis=0) + renorm_eps)
    top_weights = round_to(top_weights * scaling, weights_row.dtype.element_ty)  # to nearest, then an exact store
    tl.store(weights_row + k, top_weights.to(weights_row.dtype.element_ty), mask=k < TOP_K)
    tl.store(ids_row + k, top_ids, mask=k < TOP_K)


def moe_route(
    logits: torch.Tensor,  # [T, E]
    top_k: int,
    scoring: str = "softmax",
    score_bias: torch.Tensor | None = None,  # [E], added to the scores for the choice only
    num_groups: int = 1,
    num_topk_groups: int = 1,
    renorm: bool = False,
    scaling: float = 1.0,
    weights_dtype: torch.dtype = torch.float32,
    given_ids: torch.Tensor | None = None,  # [T, k] integer-valued (any dtype): the experts, chosen elsewhere
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, k] weights_dtype, expert ids [T, k] int32
    """One program per token: float32 scores of the logits, the choice (scores + bias, within the num_topk_groups
    groups whose two best choices sum highest), the chosen unbiased scores renormalised (sum, + 1e-20 for the
    sigmoid scorings as helios.layers.moe.route_sigmoid) and scaled. Ties go to the lower expert id.
    given_ids replaces the choice (deepseek_v4's hash layers: a table row per token id); the weights are then the
    scores at those ids, renormalised and scaled as above."""
    require_triton()
    check_last_dim_contiguous("logits", logits)
    num_tokens, num_experts = logits.shape
    assert num_experts % num_groups == 0 and num_topk_groups <= num_groups and top_k <= num_experts
    assert given_ids is None or given_ids.shape == (num_tokens, top_k), "given_ids: [T, k]"
    weights = torch.empty(num_tokens, top_k, dtype=weights_dtype, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    bias = score_bias if score_bias is not None else logits  # never read without HAS_BIAS
    given = given_ids.contiguous() if given_ids is not None else ids  # never read without HAS_IDS
    pdl = use_pdl(logits, num_tokens)
    _route_kernel[(num_tokens,)](
        logits, bias, given, weights, ids, num_experts, logits.stride(0), 0.0 if scoring == "softmax" else 1e-20,
        float(scaling), TOP_K=top_k, K_POW2=next_power_of_2(top_k), SCORING=SCORINGS[scoring],
        HAS_BIAS=score_bias is not None, HAS_IDS=given_ids is not None, NUM_GROUPS=num_groups,
        G_POW2=next_power_of_2(num_groups), TOPK_GROUPS=num_topk_groups, RENORM=renorm,
        BLOCK_E=next_power_of_2(num_experts), USE_PDL=pdl, launch_pdl=pdl,
    )
    return weights, ids


# --- sort by expert -----------------------------------------------------------------------------------------


def max_sorted_rows(num_entries: int, num_experts: int, block_m: int) -> int:
    """Rows of the block-aligned layout in the worst case: every entry, plus up to block_m - 1 padding rows for
    each expert that can receive one (at most min(entries, experts) of them)."""
    return num_entries + min(num_entries, num_experts) * (block_m - 1)


@jit
def _runs(counts, block_experts_ptr, num_rows_ptr, max_blocks, BLOCK_M: tl.constexpr):
    """From each expert's entry count: its run's rows (padded to BLOCK_M) and the runs' ends; stores the rows in use
    and each block's expert (-1 past them). Returns (padded, ends)."""
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(num_rows_ptr, total)
    b = tl.arange(0, 64)
    for start in range(0, max_blocks, 64):  # a block's expert: how many experts' runs end at or before it
        row = (start + b) * BLOCK_M
        owner = tl.sum((ends[None, :] <= row[:, None]).to(tl.int32), axis=1)
        tl.store(block_experts_ptr + start + b, tl.where(row < total, owner, -1), mask=start + b < max_blocks)
    return padded, ends


@jit
def _align_kernel(
    ids_ptr,  # [N] int32 expert of each entry (token * k + slot)
    sorted_ptr,  # [max_rows] int32 out: entry per row, N on padding rows
    block_experts_ptr,  # [max_blocks] int32 out: each block's expert, -1 past the used rows
    num_rows_ptr,  # [1] int32 out: rows in use (a multiple of BLOCK_M)
    num_entries,
    num_experts,
    max_rows,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,  # entries per step (one-hot tiles [CHUNK, BLOCK_E])
    FILL: tl.constexpr,  # rows per step of the padding fill
):
    counts = _count_entries(ids_ptr, 0, num_entries, num_entries, BLOCK_E, CHUNK)
    padded, ends = _runs(counts, block_experts_ptr, num_rows_ptr, max_blocks, BLOCK_M)
    r = tl.arange(0, FILL)
    for start in range(0, max_rows, FILL):
        tl.store(sorted_ptr + start + r, tl.zeros([FILL], tl.int32) + num_entries, mask=start + r < max_rows)
    tl.debug_barrier()  # the padding rows are written before the entries land on theirs
    _place_entries(ids_ptr, sorted_ptr, ends - padded, 0, num_entries, num_entries, BLOCK_E, CHUNK)


@jit
def _count_entries(ids_ptr, lo, hi, num_entries, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Each expert's entries among entries [lo, hi) ([BLOCK_E] int32)."""
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(lo, hi, CHUNK):
        ids = tl.load(ids_ptr + start + c, mask=start + c < num_entries, other=-1)
        counts += tl.sum((ids[:, None] == e[None, :]).to(tl.int32), axis=0)
    return counts


@jit
def _place_entries(ids_ptr, sorted_ptr, fill, lo, hi, num_entries, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr):
    """Entries [lo, hi) onto their rows, in order within each expert: `fill` [BLOCK_E] is each expert's next free
    row."""
    e = tl.arange(0, BLOCK_E)
    c = tl.arange(0, CHUNK)
    for start in range(lo, hi, CHUNK):
        in_range = start + c < num_entries
        ids = tl.load(ids_ptr + start + c, mask=in_range, other=-1)
        onehot = ids[:, None] == e[None, :]  # [CHUNK, BLOCK_E]
        earlier = (ids[:, None] == ids[None, :]) & (c[None, :] < c[:, None])  # same expert, earlier in the chunk
        row = tl.sum(tl.where(onehot, fill[None, :], 0), axis=1) + tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_ptr + row, start + c, mask=in_range)
        fill += tl.sum(onehot.to(tl.int32), axis=0)


def moe_align(
    topk_ids: torch.Tensor,  # [T, k] int32/int64
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries (token * k + slot) sorted by expert, each expert's run padded to a multiple of block_m: sorted
    [max_rows] int32 (entry ids, N = T*k on padding rows), block_experts [max_blocks] int32 (-1 past the rows in
    use), num_rows [1] int32. Within a run entries keep their order. Sizes depend on T, k, E and block_m only:
    up to ALIGN_KERNEL_MAX_ENTRIES one program's launch, beyond three (count, scan, place over ALIGN_SPAN spans),
    each layout moe_align_ref's."""
    num_entries = topk_ids.numel()
    if num_entries == 0:
        return moe_align_ref(topk_ids, num_experts, block_m)
    require_triton()
    ids = topk_ids.reshape(-1).to(torch.int32)
    max_rows = max_sorted_rows(num_entries, num_experts, block_m)
    max_blocks = cdiv(max_rows, block_m)
    sorted_ids = torch.empty(max_rows, dtype=torch.int32, device=ids.device)
    block_experts = torch.empty(max_blocks, dtype=torch.int32, device=ids.device)
    num_rows = torch.empty(1, dtype=torch.int32, device=ids.device)
    block_e = next_power_of_2(num_experts)
    if num_entries <= ALIGN_KERNEL_MAX_ENTRIES:
        _align_kernel[(1,)](ids, sorted_ids, block_experts, num_rows, num_entries, num_experts, max_rows, max_blocks,
                            BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=max(16, min(64, next_power_of_2(num_entries))),
                            FILL=1024, num_warps=8)
        return sorted_ids, block_experts, num_rows
    num_spans = cdiv(num_entries, ALIGN_SPAN)
    span_rows = cdiv(cdiv(max_rows, num_spans), 256) * 256
    span_counts = torch.empty(num_spans, block_e, dtype=torch.int32, device=ids.device)  # then each span's first rows
    _align_count_kernel[(num_spans,)](ids, span_counts, sorted_ids, num_entries, num_experts, max_rows, span_rows,
                                      SPAN=ALIGN_SPAN, BLOCK_E=block_e, CHUNK=64, FILL=256, num_warps=8)
    _align_scan_kernel[(1,)](span_counts, block_experts, num_rows, num_spans, max_blocks, BLOCK_M=block_m,
                             BLOCK_E=block_e, BLOCK_S=max(1, min(64, 8192 // block_e)), num_warps=8)
    _align_place_kernel[(num_spans,)](ids, span_counts, sorted_ids, num_entries, SPAN=ALIGN_SPAN, BLOCK_E=block_e,
                                      CHUNK=64, num_warps=8)
    return sorted_ids, block_experts, num_rows


@jit
def _align_count_kernel(
    ids_ptr,  # [N] int32
    span_counts_ptr,  # [num_spans, BLOCK_E] int32 out: each expert's entries in this program's span
    sorted_ptr,  # [max_rows] int32 out: this program's share of the rows set to N (padding until placed)
    num_entries,
    num_experts,
    max_rows,
    span_rows,
    SPAN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
    FILL: tl.constexpr,
):
    span = tl.program_id(0)
    counts = _count_entries(ids_ptr, span * SPAN, span * SPAN + SPAN, num_entries, BLOCK_E, CHUNK)
    tl.store(span_counts_ptr + span * BLOCK_E + tl.arange(0, BLOCK_E), counts)
    r = tl.arange(0, FILL)
    for start in range(span * span_rows, span * span_rows + span_rows, FILL):
        tl.store(sorted_ptr + start + r, tl.zeros([FILL], tl.int32) + num_entries, mask=start + r < max_rows)


@jit
def _align_scan_kernel(
    span_counts_ptr,  # [num_spans, BLOCK_E] int32: counts in, each span's first row per expert out
    block_experts_ptr,  # [max_blocks] int32 out
    num_rows_ptr,  # [1] int32 out
    num_spans,
    max_blocks,
    BLOCK_M: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_S: tl.constexpr,  # spans a step ([BLOCK_S, BLOCK_E] tiles)
):
    e = tl.arange(0, BLOCK_E)
    s = tl.arange(0, BLOCK_S)
    counts = tl.zeros([BLOCK_E], tl.int32)
    for start in range(0, num_spans, BLOCK_S):
        tile = tl.load(span_counts_ptr + (start + s)[:, None] * BLOCK_E + e[None, :],
                       mask=(start + s < num_spans)[:, None], other=0)
        counts += tl.sum(tile, axis=0)
    padded, ends = _runs(counts, block_experts_ptr, num_rows_ptr, max_blocks, BLOCK_M)
    first = ends - padded  # span by span, in entry order: each expert's next free row
    for start in range(0, num_spans, BLOCK_S):
        at = span_counts_ptr + (start + s)[:, None] * BLOCK_E + e[None, :]
        in_range = (start + s < num_spans)[:, None]
        tile = tl.load(at, mask=in_range, other=0)
        tl.store(at, first[None, :] + tl.cumsum(tile, axis=0) - tile, mask=in_range)
        first += tl.sum(tile, axis=0)


@jit
def _align_place_kernel(
    ids_ptr,  # [N] int32
    span_first_ptr,  # [num_spans, BLOCK_E] int32: the scan's first row per (span, expert)
    sorted_ptr,  # [max_rows] int32 out: entry per row
    num_entries,
    SPAN: tl.constexpr,
    BLOCK_E: tl.constexpr,
    CHUNK: tl.constexpr,
):
    span = tl.program_id(0)
    fill = tl.load(span_first_ptr + span * BLOCK_E + tl.arange(0, BLOCK_E))
    _place_entries(ids_ptr, sorted_ptr, fill, span * SPAN, span * SPAN + SPAN, num_entries, BLOCK_E, CHUNK)


_ONE_TOKEN_LAYOUTS: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def one_token_align(topk_ids: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """moe_align's three tensors for one token without a launch: its k experts are distinct, so each entry is its
    own expert's run (block j holds entry j, its expert ids[j]); the rows and the row count are constants of
    (k, block_m), made once per device (at a graph's warm-up, before its capture), and the block experts are a
    view of the ids. The GEMMs then read what moe_align would have given them (same rows, so the same values)."""
    assert topk_ids.shape[0] == 1, "one token's ids [1, k]"
    top_k, device = topk_ids.shape[1], topk_ids.device
    key = (device, top_k, block_m)
    if key not in _ONE_TOKEN_LAYOUTS:
        sorted_ids = torch.full((top_k, block_m), top_k, dtype=torch.int32, device=device)
        sorted_ids[:, 0] = torch.arange(top_k, dtype=torch.int32, device=device)
        _ONE_TOKEN_LAYOUTS[key] = (sorted_ids.flatten(), torch.full((1,), top_k * block_m, dtype=torch.int32,
                                                                     device=device))
    sorted_ids, num_rows = _ONE_TOKEN_LAYOUTS[key]
    return sorted_ids, topk_ids.reshape(-1).to(torch.int32), num_rows


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The entries' experts flat [N] int64, the entries sorted by expert [N] int64 (a stable sort: entry order within
    an expert) and each expert's entry count [E] int64 (by scatter-add): in torch, no host sync."""
    flat = topk_ids.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return flat, torch.sort(flat, stable=True)[1], counts


def moe_align_ref(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """moe_align in torch (sort_by_expert: no host sync either); the same three tensors."""
    flat, order, counts = sort_by_expert(topk_ids, num_experts)
    num_entries, device = flat.numel(), flat.device
    max_rows = max_sorted_rows(num_entries, num_experts, block_m)
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    expert = flat[order]
    rank = torch.arange(num_entries, device=device) - (counts.cumsum(0) - counts)[expert]
    sorted_ids = torch.full((max_rows,), num_entries, dtype=torch.int32, device=device)
    sorted_ids[(ends - padded)[expert] + rank] = order.to(torch.int32)
    rows = torch.arange(cdiv(max_rows, block_m), device=device) * block_m
    total = ends[-1:] if num_experts else torch.zeros(1, dtype=torch.long, device=device)
    owner = torch.searchsorted(ends, rows, right=True)
    block_experts = torch.where(rows < total, owner, -1).to(torch.int32)
    return sorted_ids, block_experts, total.to(torch.int32)


# --- grouped expert GEMMs -----------------------------------------------------------------------------------


@jit
def _expert_gemm_kernel(
    a_ptr,  # [rows, K]: x (a row per token: entry // ROW_DIV) or the intermediate (a row per entry)
    w_ptr,  # [E, out rows, K]: gate_up ([gate | up], GATED), up or down
    ws_ptr,  # [out rows, K]: the shared expert's weight, laid out as an expert's (its blocks only)
    out_ptr,  # [N (+ T), n_out] out, a row per entry
    sorted_ptr,  # [max_rows] int32 (moe_align)
    block_experts_ptr,  # [max_blocks] int32
    num_rows_ptr,  # [1] int32
    num_entries,  # N: the routed entries
    num_tokens,  # T: the shared expert's entries are N + t
    routed_blocks,  # block_experts' length; blocks past it (num_blocks - routed_blocks) are the shared expert's
    num_blocks,  # all blocks: the grid is num_blocks x the column tiles
    n_out,
    K,
    stride_a,
    stride_we,
    stride_wn,
    stride_out,
    limit,
    alpha,
    ROW_DIV: tl.constexpr,
    A_BY_TOKEN: tl.constexpr,  # `a` has a row per token (x, gate_up's GEMM): shared entry N + t reads row t
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,  # 0 none, 1 gate <= limit and |up| <= limit, 2 act(gate) <= limit and |up| <= limit
    HAS_ALPHA: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 operands at full precision (not tf32); bf16 ones too in the interpreter
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,  # 0: blocks vary fastest (each weight tile once for all blocks); else see gemm_config
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    num_tiles = tl.cdiv(n_out, BLOCK_N)
    if GROUP_M == 0:
        pid_m = pid % num_blocks
        pid_n = pid // num_blocks
    else:  # GROUP_M blocks sweep the column tiles together: their rows of `a` stay in L2 across the sweep
        in_group = GROUP_M * num_tiles
        first = pid // in_group * GROUP_M
        size = tl.minimum(num_blocks - first, GROUP_M)
        pid_m = first + (pid % in_group) % size
        pid_n = (pid % in_group) // size
    pdl_wait(USE_PDL)  # the rows, the experts and `a` are the kernels' before
    pdl_launch_dependents(USE_PDL)
    if (pid_m < routed_blocks) & (pid_m * BLOCK_M >= tl.load(num_rows_ptr)):
        return
    rows = tl.arange(0, BLOCK_M)
    if pid_m >= routed_blocks:  # the shared expert's blocks: every token, in token order
        entry = num_entries + (pid_m - routed_blocks) * BLOCK_M + rows
        is_row = entry < num_entries + num_tokens
        if A_BY_TOKEN:
            a_row = entry - num_entries
        else:
            a_row = entry
        w_base = ws_ptr
    else:
        entry = tl.load(sorted_ptr + pid_m * BLOCK_M + rows)
        is_row = entry < num_entries
        a_row = entry // ROW_DIV
        w_base = w_ptr + tl.load(block_experts_ptr + pid_m).to(tl.int64) * stride_we
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row.to(tl.int64)[:, None] * stride_a + k[None, :]
    w_ptrs = w_base + n[None, :].to(tl.int64) * stride_wn + k[:, None]  # [BLOCK_K, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = k0 + k < K
        a = tl.load(a_ptrs + k0, mask=is_row[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE_DOT:
            a = a.to(tl.float32)
        acc = _dot(a, w, acc, IEEE_DOT)
        if GATED:  # the up rows sit n_out rows below the gate rows
            w_up = tl.load(w_ptrs + n_out * stride_wn + k0, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc_up = _dot(a, w_up, acc_up, IEEE_DOT)
    y = round_to(_epilogue(acc, acc_up, limit, alpha, ACT, CLAMP, HAS_ALPHA, out_ptr.dtype.element_ty),
               out_ptr.dtype.element_ty)  # the store is then exact
    out_ptrs = out_ptr + entry.to(tl.int64)[:, None] * stride_out + n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=is_row[:, None] & n_ok[None, :])


@jit
def _dot(a, w, acc, IEEE_DOT: tl.constexpr):
    if IEEE_DOT:
        acc = tl.dot(a, w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc)
    return acc


@jit
def _epilogue(g, u, limit, alpha, ACT: tl.constexpr, CLAMP: tl.constexpr, HAS_ALPHA: tl.constexpr,
              DT: tl.constexpr):
    """helios.layers.activation.gated (ACT 1, 2: act(gate) * up, with its clamps and SwiGLU-OAI) or relu2 (3) of
    the float32 accumulators; ACT 0 passes g through. Rounded to DT (the output dtype) wherever the torch path
    (and HF's expert loop) holds a tensor of that dtype: a 16-bit model's tokens then follow HF's more closely."""
    y = g
    if ACT == 3:
        r = tl.maximum(round_to(g, DT), 0.0)
        y = r * r
    elif ACT != 0:
        g = round_to(g, DT)
        u = round_to(u, DT)
        if CLAMP == 1:
            g = round_to(tl.minimum(g, limit), DT)
        if CLAMP != 0:
            u = round_to(tl.minimum(tl.maximum(u, -limit), limit), DT)
        if HAS_ALPHA:
            sig = round_to(1.0 / (1.0 + tl.exp(-round_to(g * alpha, DT))), DT)  # gate * alpha held in DT, as torch
            y = round_to(u + 1.0, DT) * round_to(g * sig, DT)
        else:
            if ACT == 2:  # torch's GeluKernel order, as helios.kernels.activation: (x * x) * x first
                act = 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * (g * g * g))))
            else:
                act = g / (1.0 + tl.exp(-g))
            act = round_to(act, DT)
            if CLAMP == 2:
                act = round_to(tl.minimum(act, limit), DT)
            y = act * u
    return y


def gemm_config(num_entries: int) -> dict:
    """Tile sizes by the number of entries: decode batches take 16-row blocks (each expert's few tokens share one
    block, so its weight tiles are read once per step), prefill 64-row ones.
    NOTE: one BLOCK_K for both, so an entry's products sum their K chunks in the same order at every batch size."""
    # H200, 256 experts x [1024 | 512, 2048] bf16: 65% of the bound at b=1, 100% at b=64
    if num_entries <= DECODE_ENTRIES:
        return {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4, "GROUP_M": 0}
    if num_entries < 16384:  # under ~64 rows an expert (256 experts): 128-row blocks would be mostly padding
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3, "GROUP_M": 8}
    # NOTE: H200 sweep of a 4096-token prompt (benchmarks/gpu_moe_prefill.py, session 17): 128 x 64 on 8 warps took
    # mimo_v2_flash's two GEMMs 8.75 -> 7.97 ms and kimi_linear's 3.10 -> 2.96 ms (qwen3_5_moe's 1.79 -> 1.83), the
    # same bits as 64 x 64; 64 x 128 does not fit the shared memory at 3 stages. No tile of the sweep passed ~26% of
    # the matmul rate: this kernel, not its tile, is what bounds MoE prefill
    # GROUP_M (program order) changes no bits: each program computes its tile as before. NOTE: with blocks varying
    # fastest (GROUP_M 0), a block's rows of `a` are read again for every column tile (32-64 tiles) from HBM, ~17 GB
    # a 4096-token mimo_v2_flash prompt against 13 GB of expert weights; 8 blocks sweeping the tiles together keep
    # theirs in L2. H100 sweep (session 18): GROUP_M 8 took the two GEMMs 1.74 -> 1.48 ms (qwen3_5_moe), 3.21 -> 2.48
    # (kimi_linear), 9.42 -> 6.79 (mimo_v2_flash); 4 within 2% of 8, 16 slower for the smallest shape
    return {"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "GROUP_M": 8}


def down_config(cfg: dict, element_size: int, shared_bytes: int | None) -> dict:
    """The down GEMM's tile beside gate_up's `cfg` (gemm_config's): the prompt-sized row (128-row blocks) takes
    128 columns where its stages fit `shared_bytes` (the device's opt-in shared memory a block; None: no limit),
    else cfg. Same blocks (moe_align's) and BLOCK_K, so the same bits.
    NOTE: H200 sweep (benchmarks/gpu_moe_prefill.py, session 28), each GEMM of a 4096-token prompt alone: the down
    GEMM at 128 x 128 on 8 warps, 3 stages, 0.509 -> 0.365 ms (qwen3_5_moe: K = 512, 4 K steps a tile), 0.841 ->
    0.617 (kimi_linear), 2.619 -> 1.984 (mimo_v2_flash); gate_up at 128 x 128 needs 288 KB (a and two weight tiles)
    and does not fit. Its 192 KB fit an H100 / H200 (227 KB), not an A100 (163 KB), nor a float32 GEMM."""
    if cfg["BLOCK_M"] != 128:
        return cfg
    wide = {**cfg, "BLOCK_N": 128}
    need = wide["num_stages"] * (wide["BLOCK_M"] + wide["BLOCK_N"]) * wide["BLOCK_K"] * element_size
    return wide if shared_bytes is None or need <= shared_bytes else cfg


def shared_bytes_of(device) -> int | None:
    """The opt-in shared memory a block may use on `device`'s GPU; None off CUDA (the interpreter has no limit)."""
    device = torch.device(device)
    return _shared_bytes(device.index or 0) if device.type == "cuda" else None


@functools.lru_cache(maxsize=None)
def _shared_bytes(index: int) -> int:
    return torch.cuda.get_device_properties(index).shared_memory_per_block_optin


def expert_gemm(
    a: torch.Tensor,  # [rows, K]: x [T, K] (row_div = k) or the intermediate [N, K] (row_div = 1)
    w: torch.Tensor,  # [E, out rows, K]
    align: tuple[torch.Tensor, torch.Tensor, torch.Tensor],  # moe_align's output for this config's BLOCK_M
    num_entries: int,
    row_div: int,
    act: str = "none",
    limit: float | None = None,
    clamp_after_act: bool = False,
    alpha: float | None = None,
    config: dict | None = None,
    pdl: bool = False,
    shared: torch.Tensor | None = None,  # [out rows, K]: a shared expert every token takes, as entry N + t
    num_tokens: int = 0,  # T, with shared
    a_by_token: bool | None = None,  # `a` has a row per token (x); None: row_div > 1
) -> torch.Tensor:  # [N (+ T with shared), n_out] in a's dtype: n_out = out rows / 2 for gated acts, else out rows
    """One grouped GEMM over the block-aligned entries: program (block, column tile) multiplies its block's rows
    of `a` by its expert's weight tile, the activation applied to the float32 accumulators. pdl: launched under
    PDL (the caller's use_pdl over the step's tokens). shared: cdiv(T, BLOCK_M) more blocks after the routed ones
    multiply every token (x's row t, or the intermediate's row N + t) by the shared expert's weight, into rows
    N + t: its products take the routed experts' tile, K chunks and epilogue."""
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("w", w)
    assert a.shape[1] == w.shape[2] and a.dtype == w.dtype, f"a {tuple(a.shape)} {a.dtype}, w {tuple(w.shape)}"
    if shared is not None:
        assert shared.shape == w.shape[1:] and shared.dtype == w.dtype and shared.stride() == w.stride()[1:], (
            f"shared {tuple(shared.shape)} {shared.stride()}, an expert's {tuple(w.shape[1:])} {w.stride()[1:]}")
    gated = act in ("silu", "gelu_tanh")
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    cfg = dict(config or gemm_config(num_entries))
    cfg.setdefault("GROUP_M", 0)
    sorted_ids, block_experts, num_rows = align
    extra = num_tokens if shared is not None else 0
    out = torch.empty(num_entries + extra, n_out, dtype=a.dtype, device=a.device)
    routed_blocks = block_experts.numel()
    num_blocks = routed_blocks + cdiv(extra, cfg["BLOCK_M"])
    grid = (num_blocks * cdiv(n_out, cfg["BLOCK_N"]),)
    _expert_gemm_kernel[grid](
        a, w, shared if shared is not None else w, out, sorted_ids, block_experts, num_rows, num_entries, extra,
        routed_blocks, num_blocks, n_out, a.shape[1], a.stride(0), w.stride(0), w.stride(1), out.stride(0),
        float(limit or 0.0), float(alpha or 0.0), ROW_DIV=row_div,
        A_BY_TOKEN=row_div > 1 if a_by_token is None else a_by_token, ACT=ACTS[act],
        GATED=gated, CLAMP=0 if limit is None else (2 if clamp_after_act else 1), HAS_ALPHA=alpha is not None,
        IEEE_DOT=a.dtype == torch.float32 or interpret_mode(), USE_PDL=pdl, launch_pdl=pdl, **cfg,
    )
    return out


def expert_outputs(
    x: torch.Tensor,  # [T, W]
    topk_ids: torch.Tensor,  # [T, k]
    w_in: torch.Tensor,  # [E, 2*F, W] gate_up (gated act) or [E, F, W] up (relu2)
    w_down: torch.Tensor,  # [E, W, F]
    act: str,
    limit: float | None = None,
    clamp_after_act: bool = False,
    alpha: float | None = None,
    one_token: str = "dot",
    shared: tuple[torch.Tensor, torch.Tensor] | None = None,  # a shared expert's (w_in [2*F, W], w_down [W, F])
) -> torch.Tensor:  # [T*k (+ T), W] in x's dtype: entry token * k + slot is its expert's output for the token
    """Each (token, slot)'s expert product down(act(gate_up x)), unweighted: align, then the two grouped GEMMs.
    one_token="gemv": a single token takes expert_outputs_one_token's GEMV kernels instead ("dot": the GEMMs).
    shared: a shared expert of the routed experts' shapes and activation rides in the same two launches (the dot
    path): its output for token t is row T*k + t (shared_slot_serves says when a layer may ask)."""
    require_triton()
    assert one_token in ("dot", "gemv"), f"one_token: dot or gemv, not {one_token!r}"
    num_tokens, num_entries = topk_ids.shape[0], topk_ids.numel()
    if num_entries == 0:
        return x.new_empty(0, w_down.shape[1])
    if one_token == "gemv" and num_tokens == 1:
        assert shared is None, "the one-token GEMVs take no shared expert"
        return expert_outputs_one_token(x, topk_ids, w_in, w_down, act, limit, clamp_after_act, alpha)
    cfg = gemm_config(num_entries)
    if num_tokens == 1:  # batch-1 decode: no sort to do, one launch fewer
        align = one_token_align(topk_ids, cfg["BLOCK_M"])
    else:
        align = moe_align(topk_ids, w_in.shape[0], cfg["BLOCK_M"])
    pdl = use_pdl(x, num_tokens)
    shared_in, shared_down = shared if shared is not None else (None, None)
    h = expert_gemm(x, w_in, align, num_entries, topk_ids.shape[1], act, limit, clamp_after_act, alpha, cfg, pdl,
                    shared_in, num_tokens, a_by_token=True)
    down = down_config(cfg, h.element_size(), shared_bytes_of(h.device))
    return expert_gemm(h, w_down, align, num_entries, 1, config=down, pdl=pdl, shared=shared_down,
                       num_tokens=num_tokens, a_by_token=False)


def shared_slot_serves(num_entries: int, one_token: str, num_tokens: int, w_in: torch.Tensor, w_down: torch.Tensor,
                       shared_in: torch.Tensor, shared_down: torch.Tensor) -> bool:
    """Whether a shared expert may ride in expert_outputs' launches: decode-sized batches (gemm_config's 16-row
    blocks: a prompt's shared product stays with cuBLAS, faster than this kernel at full rows), the dot path, and
    weights laid out as one expert's of the stacks (same shapes, strides and dtype).
    NOTE: at batch 1 this takes qwen3_5_moe's shared gate_up and down GEMVs (two launches of about 2M weights each
    a MoE layer) into the experts' two launches; every row's products are the same kernel's at every decode batch."""
    return (num_entries <= DECODE_ENTRIES and not (one_token == "gemv" and num_tokens == 1)
            and shared_in.shape == w_in.shape[1:] and shared_down.shape == w_down.shape[1:]
            and shared_in.dtype == w_in.dtype and shared_down.dtype == w_down.dtype
            and shared_in.stride() == w_in.stride()[1:] and shared_down.stride() == w_down.stride()[1:])


def expert_outputs_ref(x, topk_ids, w_in, w_down, act, limit=None, clamp_after_act=False, alpha=None):
    """expert_outputs in torch by gathered weights (tests only: it copies each entry's expert weights)."""
    import torch.nn.functional as F

    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    xs = x.float().repeat_interleave(top_k, dim=0)
    h = torch.einsum("nw,nfw->nf", xs, w_in[ids].float()).to(x.dtype)  # the torch path's roundings
    if act == "relu2":
        h = F.relu(h).square()
    else:
        g, u = h.chunk(2, dim=-1)
        if limit is not None and not clamp_after_act:
            g = g.clamp(max=limit)
        if limit is not None:
            u = u.clamp(-limit, limit)
        if alpha is not None:
            h = (u + 1.0) * g * torch.sigmoid(g * alpha)
        else:
            a = F.silu(g) if act == "silu" else F.gelu(g, approximate="tanh")
            h = (a.clamp(max=limit) if limit is not None and clamp_after_act else a) * u
    h = h.to(x.dtype).float()
    return torch.einsum("nf,nwf->nw", h, w_down[ids].float()).to(x.dtype)


# --- one token: GEMV expert products ------------------------------------------------------------------------
# At batch 1 the grouped GEMM's 16-row tl.dot carries 15 padding rows and its gate_up launch has k x F/32 programs
# (128 for qwen3_5_moe): few bytes in flight. These kernels stream each slot's expert like helios.kernels.gemv:
# program (slot, row tile, K range) multiplies BLOCK_N weight rows by the row in float32 FMAs over BLOCK_K chunks,
# one chunk ahead in registers; split-K partials are summed in a fixed order (no atomics) by a second kernel that
# applies the activation to the full sums. `_epilogue` rounds the float32 sums as the grouped GEMM's does.

# ~2 programs per SM of an H100 / H200: below this, a launch splits K to fill the chip (as gemv.default_config)
_ONE_TOKEN_TARGET_PROGRAMS = 264


class ExpertGemvConfig(NamedTuple):
    block_n: int  # output rows per program (gated: that many gate rows and as many up rows)
    block_k: int  # K elements per chunk (power of two)
    num_warps: int
    split_k: int  # K ranges per row tile; > 1 adds float32 partials and a reduce launch
    row_acc: bool = False  # each chunk's products summed to one float32 per row as it lands (fewer registers,
    # a cross-lane sum per chunk); else a [BLOCK_N, BLOCK_K] accumulator summed once after the loop


def one_token_config(n_out: int, k_dim: int, top_k: int, dtype: torch.dtype = torch.bfloat16) -> ExpertGemvConfig:
    """A starting tile for one of the two products (n_out output rows over k_dim): 1 KB row chunks of 16-bit
    weights, 8 rows a program, K split until the launch has ~2 programs per SM, row sums per chunk. Unmeasured:
    the benchmark (benchmarks/gpu_moe_decode.py) sweeps the others.
    NOTE: row_acc by ptxas's count for sm90 (Triton 3.9): gate_up's 8 x 512 tile takes 128 registers a thread with
    it (4 programs of 4 warps an SM), 167 without (3); down's 72 against 95."""
    block_k = min(512 if dtype.itemsize <= 2 else 256, next_power_of_2(k_dim))
    block_n = 8
    tiles = top_k * cdiv(n_out, block_n)
    split_k = 1
    while tiles * split_k < _ONE_TOKEN_TARGET_PROGRAMS and k_dim // (block_k * split_k * 2) >= 1:
        split_k *= 2
    return ExpertGemvConfig(block_n, block_k, 4, split_k, row_acc=True)


@jit
def _w_chunk(w_rows, cols, n_ok, k_end, EVEN: tl.constexpr):
    """A [BLOCK_N, BLOCK_K] weight chunk at cols ([BLOCK_K]); masked only off the even layout."""
    if EVEN:
        w = tl.load(w_rows + cols[None, :])
    else:
        w = tl.load(w_rows + cols[None, :], mask=n_ok[:, None] & (cols < k_end)[None, :], other=0.0)
    return w


@jit
def _expert_gemv_kernel(
    a_ptr,  # [rows, K]: x [1, K] (ROW_DIV = k: every slot reads row 0) or the intermediate [k, K] (ROW_DIV = 1)
    w_ptr,  # [E, out rows, K]: gate_up ([gate | up], GATED), up or down
    out_ptr,  # [k, n_out] (SPLIT_K == 1) or float32 partials [SPLIT_K, k, out rows] contiguous
    ids_ptr,  # [k] int32: each slot's expert
    n_out,
    K,
    k_per_split,  # multiple of BLOCK_K
    stride_a,
    stride_we,
    stride_wn,
    stride_out,  # out's row stride (partials: out rows)
    stride_os,  # partials: stride between splits (0 when SPLIT_K == 1)
    limit,
    alpha,
    ROW_DIV: tl.constexpr,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,  # as _expert_gemm_kernel's
    HAS_ALPHA: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # n_out % BLOCK_N == 0 and every K range is whole chunks inside K: no masks
    EARLY_W: tl.constexpr,  # the ids and the first weight chunk are read before pdl_wait (see expert_gemv)
    ROW_ACC: tl.constexpr,  # ExpertGemvConfig.row_acc
    USE_PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    k_begin = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    offs_k = tl.arange(0, BLOCK_K)
    if not EARLY_W:
        pdl_wait(USE_PDL)
    expert = tl.load(ids_ptr + slot).to(tl.int64)
    g_rows = w_ptr + expert * stride_we + n.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    u_rows = g_rows + n_out * stride_wn  # the up rows sit n_out rows below the gate rows (read with GATED)
    g_next = _w_chunk(g_rows, k_begin + offs_k, n_ok, k_end, EVEN)
    u_next = g_next
    if GATED:
        u_next = _w_chunk(u_rows, k_begin + offs_k, n_ok, k_end, EVEN)
    if EARLY_W:
        pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    a_row = a_ptr + (slot // ROW_DIV).to(tl.int64) * stride_a
    if ROW_ACC:
        acc = tl.zeros([BLOCK_N], tl.float32)
        acc_up = tl.zeros([BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)  # reduced over K once, after the loop
        acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k in range(k_begin, k_end, BLOCK_K):
        g = g_next
        u = u_next
        cols = k + offs_k
        nxt = cols + BLOCK_K
        if EVEN:  # one chunk ahead; past the range a scalar mask drops the load (16-byte vectors kept)
            has_next = tl.full([BLOCK_N, BLOCK_K], 1, tl.int1) & (k + BLOCK_K < k_end)
            g_next = tl.load(g_rows + nxt[None, :], mask=has_next, other=0.0)
            if GATED:
                u_next = tl.load(u_rows + nxt[None, :], mask=has_next, other=0.0)
            a = tl.load(a_row + cols).to(tl.float32)[None, :]
        else:
            g_next = _w_chunk(g_rows, nxt, n_ok, k_end, False)
            if GATED:
                u_next = _w_chunk(u_rows, nxt, n_ok, k_end, False)
            a = tl.load(a_row + cols, mask=cols < k_end, other=0.0).to(tl.float32)[None, :]
        if ROW_ACC:
            acc += tl.sum(g.to(tl.float32) * a, axis=1)
            if GATED:
                acc_up += tl.sum(u.to(tl.float32) * a, axis=1)
        else:
            acc += g.to(tl.float32) * a
            if GATED:
                acc_up += u.to(tl.float32) * a
    if ROW_ACC:
        g_sum = acc  # [BLOCK_N]
        u_sum = acc_up
    else:
        g_sum = tl.sum(acc, axis=1)
        u_sum = tl.sum(acc_up, axis=1)
    if SPLIT_K == 1:
        y = round_to(_epilogue(g_sum, u_sum, limit, alpha, ACT, CLAMP, HAS_ALPHA, out_ptr.dtype.element_ty),
                     out_ptr.dtype.element_ty)  # the store is then exact
        tl.store(out_ptr + slot * stride_out + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)
    else:
        part = out_ptr + tl.program_id(2) * stride_os + slot * stride_out + n
        tl.store(part, g_sum, mask=n_ok)
        if GATED:
            tl.store(part + n_out, u_sum, mask=n_ok)


@jit
def _expert_gemv_reduce_kernel(
    partial_ptr,  # [SPLIT_K, k, out rows] float32 contiguous
    out_ptr,  # [k, n_out]
    n_out,
    stride_ps,  # k * out rows
    stride_pk,  # out rows
    limit,
    alpha,
    ACT: tl.constexpr,
    GATED: tl.constexpr,
    CLAMP: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    slot = tl.program_id(0)
    n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    n_ok = n < n_out
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    rows = partial_ptr + slot * stride_pk + n
    g = tl.zeros([BLOCK], tl.float32)
    u = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):  # fixed order: the same bits on every run
        g += tl.load(rows + s * stride_ps, mask=n_ok, other=0.0)
        if GATED:
            u += tl.load(rows + s * stride_ps + n_out, mask=n_ok, other=0.0)
    y = round_to(_epilogue(g, u, limit, alpha, ACT, CLAMP, HAS_ALPHA, out_ptr.dtype.element_ty),
                 out_ptr.dtype.element_ty)
    tl.store(out_ptr + slot * n_out + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


def expert_gemv(
    a: torch.Tensor,  # [1, K] x (row_div = k) or [k, K] the intermediate (row_div = 1)
    w: torch.Tensor,  # [E, out rows, K]
    ids: torch.Tensor,  # [k] int32 contiguous: each slot's expert
    row_div: int,
    act: str = "none",
    limit: float | None = None,
    clamp_after_act: bool = False,
    alpha: float | None = None,
    config: ExpertGemvConfig | None = None,
    pdl: bool = False,
    early_weights: bool = False,
) -> torch.Tensor:  # [k, n_out] in a's dtype: n_out = out rows / 2 for gated acts, else out rows
    """One token's product with each of its k experts, row j by expert ids[j], the activation applied to the
    float32 sums (after the split-K reduce when split). pdl: launched under PDL. early_weights (with pdl): the ids
    and the first weight chunk are read before pdl_wait; only for a launch whose ids a kernel before the previous
    one wrote.
    NOTE: safe there because every kernel of this path signals its dependents after its own wait: by the time this
    launch starts, the kernel before the previous one has finished and its writes are visible."""
    check_last_dim_contiguous("a", a)
    check_last_dim_contiguous("w", w)
    assert a.shape[1] == w.shape[2] and a.dtype == w.dtype, f"a {tuple(a.shape)} {a.dtype}, w {tuple(w.shape)}"
    assert ids.dim() == 1 and ids.dtype == torch.int32 and ids.is_contiguous(), "ids: [k] int32"
    top_k, k_dim = ids.numel(), a.shape[1]
    assert a.shape[0] * row_div == top_k, f"a {tuple(a.shape)} with row_div {row_div} for {top_k} slots"
    gated = act in ("silu", "gelu_tanh")
    n_out = w.shape[1] // 2 if gated else w.shape[1]
    cfg = config or one_token_config(n_out, k_dim, top_k, a.dtype)
    assert cfg.block_n & (cfg.block_n - 1) == 0 and cfg.block_k & (cfg.block_k - 1) == 0, f"{cfg}: powers of two"
    k_per_split = cdiv(cdiv(k_dim, max(1, cfg.split_k)), cfg.block_k) * cfg.block_k
    split_k = cdiv(k_dim, k_per_split)  # no empty ranges
    out = torch.empty(top_k, n_out, dtype=a.dtype, device=a.device)
    if split_k > 1:
        target = torch.empty(split_k, top_k, w.shape[1], dtype=torch.float32, device=a.device)
    else:
        target = out
    clamp = 0 if limit is None else (2 if clamp_after_act else 1)
    epilogue = dict(ACT=ACTS[act], GATED=gated, CLAMP=clamp, HAS_ALPHA=alpha is not None)
    _expert_gemv_kernel[(top_k, cdiv(n_out, cfg.block_n), split_k)](
        a, w, target, ids, n_out, k_dim, k_per_split, a.stride(0), w.stride(0), w.stride(1), target.stride(-2),
        target.stride(0) if split_k > 1 else 0, float(limit or 0.0), float(alpha or 0.0), ROW_DIV=row_div,
        SPLIT_K=split_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN=n_out % cfg.block_n == 0 and k_dim % k_per_split == 0, EARLY_W=early_weights and pdl,
        ROW_ACC=cfg.row_acc, USE_PDL=pdl, num_warps=cfg.num_warps, num_stages=1, launch_pdl=pdl, **epilogue,
    )
    if split_k > 1:
        block = min(1024, next_power_of_2(n_out))
        _expert_gemv_reduce_kernel[(top_k, cdiv(n_out, block))](
            target, out, n_out, target.stride(0), target.stride(1), float(limit or 0.0), float(alpha or 0.0),
            SPLIT_K=split_k, BLOCK=block, USE_PDL=pdl, num_warps=4, launch_pdl=pdl, **epilogue,
        )
    return out


def expert_outputs_one_token(
    x: torch.Tensor,  # [1, W]
    topk_ids: torch.Tensor,  # [1, k]
    w_in: torch.Tensor,  # [E, 2*F, W] gate_up (gated act) or [E, F, W] up (relu2)
    w_down: torch.Tensor,  # [E, W, F]
    act: str,
    limit: float | None = None,
    clamp_after_act: bool = False,
    alpha: float | None = None,
    config: tuple[ExpertGemvConfig, ExpertGemvConfig] | None = None,  # (gate_up's, down's); None: one_token_config
    early_down: bool = True,
) -> torch.Tensor:  # [k, W] in x's dtype: row j is slot j's expert output, as expert_outputs lays it out
    """expert_outputs for one token through the GEMV kernels: gate_up with its activation, then down. Under PDL the
    down launch reads its first weight chunk before its wait unless early_down=False (expert_gemv's note)."""
    require_triton()
    assert x.shape[0] == 1 and topk_ids.shape[0] == 1, f"one token: x {tuple(x.shape)}, ids {tuple(topk_ids.shape)}"
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).to(torch.int32).contiguous()
    cfg_in, cfg_down = config or (None, None)
    pdl = use_pdl(x, 1)
    h = expert_gemv(x, w_in, ids, top_k, act, limit, clamp_after_act, alpha, cfg_in, pdl)
    return expert_gemv(h, w_down, ids, 1, config=cfg_down, pdl=pdl, early_weights=early_down)


# --- combine ------------------------------------------------------------------------------------------------


@jit
def _combine_kernel(
    y_ptr,  # [T*k, W]
    weights_ptr,  # [T, k]
    ids_ptr,  # [T, k] expert ids
    shared_ptr,  # [T, W] the shared expert's output (read with HAS_SHARED)
    gate_ptr,  # [T, 1] its gate's logit (read with SHARED_GATED)
    out_ptr,  # [T, W] out: the sum, or with THEN_NORM the norm of residual + the sum
    residual_ptr,  # [T, W] the residual stream (read with THEN_NORM)
    stream_ptr,  # [T, W] out with THEN_NORM: residual + the sum
    norm_w_ptr,  # [W] the next norm's weight (read with THEN_NORM)
    width,
    stride_shared,
    stride_gate,
    stride_residual,
    eps,
    TOP_K: tl.constexpr,
    K_POW2: tl.constexpr,
    HAS_SHARED: tl.constexpr,
    SHARED_GATED: tl.constexpr,
    THEN_NORM: tl.constexpr,  # the next norm of the stream (one program a token over the whole row)
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK_W: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    mask = cols < width
    k = tl.arange(0, K_POW2)
    ids = tl.load(ids_ptr + t * TOP_K + k, mask=k < TOP_K, other=2**30).to(tl.int32)
    weights = tl.load(weights_ptr + t * TOP_K + k, mask=k < TOP_K, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_W], tl.float32)
    for _ in tl.static_range(TOP_K):  # slots by expert id, as the torch loop adds them
        j = tl.argmin(ids, axis=0)
        w = tl.sum(tl.where(k == j, weights, 0.0), axis=0)
        y = tl.load(y_ptr + (t * TOP_K + j) * width + cols, mask=mask, other=0.0).to(tl.float32)
        acc = round_to(acc + round_to(w * y, out_ptr.dtype.element_ty), out_ptr.dtype.element_ty)
        ids = tl.where(k == j, 2**30, ids)
    if HAS_SHARED:  # routed + shared, or routed + sigmoid(gate) * shared: each op rounded as torch's
        shared = tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
        if SHARED_GATED:
            g = tl.load(gate_ptr + t * stride_gate).to(tl.float32)
            scale = round_to(1.0 / (1.0 + tl.exp(-g)), out_ptr.dtype.element_ty)
            shared = round_to(scale * shared, out_ptr.dtype.element_ty)
        acc = round_to(acc + shared, out_ptr.dtype.element_ty)
    if THEN_NORM:  # helios.kernels.rmsnorm's fused add and norm of the stream, as its kernel computes them
        r = tl.load(residual_ptr + t * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        x = (acc + r).to(out_ptr.dtype.element_ty)
        tl.store(stream_ptr + t * width + cols, x, mask=mask)
        w = tl.load(norm_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        acc = _normalize(x, w, width, eps, 1, MULTIPLY_IN_FLOAT32)
    tl.store(out_ptr + t * width + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def moe_combine(
    y: torch.Tensor,  # [T*k, W] contiguous
    weights: torch.Tensor,  # [T, k]
    topk_ids: torch.Tensor,  # [T, k]
    shared: torch.Tensor | None = None,  # [T, W] in y's dtype: a shared expert's output every token adds
    shared_gate: torch.Tensor | None = None,  # [T, 1]: its gate's logit (shared scaled by sigmoid of it)
    then_norm: ThenNorm | None = None,  # the residual stream and the next RMSNorm
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # [T, W] in y's dtype; with then_norm (normed, stream)
    """out[t] = the sum over slots j of weights[t, j] * y[t*k + j], as helios.layers.moe's torch loop (and HF's) adds
    it: slots in expert-id order, each product and each partial sum rounded to y's dtype (exact in float32); then
    `+ shared` or `+ sigmoid(shared_gate) * shared` in the same launch, each op rounded as torch rounds it.
    then_norm: the stream residual + out and its RMSNorm in the same launch, as helios.kernels.rmsnorm's fused add
    and norm compute them (the next layer's norm taken here: one launch a MoE layer fewer); returns (norm, stream)."""
    require_triton()
    num_tokens, top_k = weights.shape
    width = y.shape[1]
    assert y.is_contiguous() and y.shape[0] == num_tokens * top_k, f"y {tuple(y.shape)}, weights {tuple(weights.shape)}"
    assert shared is not None or shared_gate is None, "a shared gate needs the shared expert's output"
    if shared is not None:
        assert shared.shape == (num_tokens, width) and shared.dtype == y.dtype, f"shared {tuple(shared.shape)}"
        check_last_dim_contiguous("shared", shared)
    if shared_gate is not None:
        assert shared_gate.shape == (num_tokens, 1), f"shared_gate {tuple(shared_gate.shape)}"
    out = torch.empty(num_tokens, width, dtype=y.dtype, device=y.device)
    stream = out
    if then_norm is not None:
        residual = then_norm.residual
        assert residual.shape == (num_tokens, width) and residual.dtype == y.dtype, f"residual {tuple(residual.shape)}"
        assert then_norm.weight.shape == (width,), f"norm weight {tuple(then_norm.weight.shape)}"
        check_last_dim_contiguous("residual", residual)
        stream = torch.empty_like(out)
    if num_tokens == 0:
        return out if then_norm is None else (out, stream)
    block_w = next_power_of_2(width) if then_norm is not None else min(1024, next_power_of_2(width))
    pdl = use_pdl(y, num_tokens)
    _combine_kernel[(num_tokens, cdiv(width, block_w))](
        y, weights.contiguous(), topk_ids.contiguous(), shared if shared is not None else y,
        shared_gate if shared_gate is not None else y, out,
        then_norm.residual if then_norm is not None else y, stream,
        then_norm.weight if then_norm is not None else y, width,
        shared.stride(0) if shared is not None else 0, shared_gate.stride(0) if shared_gate is not None else 0,
        then_norm.residual.stride(0) if then_norm is not None else 0,
        then_norm.eps if then_norm is not None else 0.0,
        TOP_K=top_k, K_POW2=next_power_of_2(top_k), HAS_SHARED=shared is not None,
        SHARED_GATED=shared_gate is not None, THEN_NORM=then_norm is not None,
        MULTIPLY_IN_FLOAT32=then_norm is not None and then_norm.multiply_in_float32, BLOCK_W=block_w,
        USE_PDL=pdl, num_warps=_row_warps(block_w) if then_norm is not None else 4, launch_pdl=pdl)
    return out if then_norm is None else (out, stream)


class ThenNorm(NamedTuple):
    """The next RMSNorm of the residual stream, taken in a MoE block's combine launch (moe_combine's then_norm):
    stream = residual + the block's output, then stream's norm with `weight` (applied after the rounding, or in
    float32 with multiply_in_float32), as RMSNorm.forward_add computes them."""

    residual: torch.Tensor  # [T, W]
    weight: torch.Tensor  # [W]
    eps: float
    multiply_in_float32: bool


def moe_combine_ref(y: torch.Tensor, weights: torch.Tensor, topk_ids: torch.Tensor,
                    shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    num_tokens, top_k = weights.shape
    order = topk_ids.long().argsort(dim=1)
    terms = (y.float().view(num_tokens, top_k, -1) * weights.float()[..., None]).to(y.dtype)
    terms = terms.gather(1, order[..., None].expand_as(terms))
    out = torch.zeros(num_tokens, y.shape[1], dtype=y.dtype, device=y.device)
    for j in range(top_k):
        out = out + terms[:, j]
    if shared is not None:
        out = out + (shared if shared_gate is None else torch.sigmoid(shared_gate) * shared)
    return out
