"""Mamba-2's selective scan (nemotron_h) on the GPU: slot-indexed varlen kernels for decode and prefill.

Batch layout as helios.kernels.gated_delta's (sequence i: rows query_start_loc[i]:query_start_loc[i+1], first
position starts[i], 0 = fresh: the slot is never read, slots[i]: its state row, read and written in place). State
[S, H, P, N] float32 (HF's [heads, head_dim, state_dim]). Head h reads B and C of group h // (H / G).
Per token: dt = clamp(softplus(dt + dt_bias)) (the sum and the softplus rounded to dt's dtype, as HF), S <- exp(dt A)
S + dt x B^T, y = S C + D x, A = -exp(A_log). Two kernels, each walking a sequence in order with its state tile in
float32 registers: the sequential one token by token (decode steps, and prefill where the layer's chunk is under
16), the chunked one a chunk at a time (SSD's form with float32 ieee products), its chunks cut at absolute multiples
of a divisor of the layer's chunk_size, as the CPU path's: a sequence's bits depend neither on its batch nor on
where the scheduler split its prompt. A decode step takes mamba2_decode instead: gated_delta's causal conv (silu)
and the sequential step in one launch, from in_proj's xBC. Graph-safe: device-side bounds, no host sync, a grid
fixed by the shapes. Imports torch and helios.kernels._triton / gated_delta; nothing else.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    COUNTER_SLOTS,
    arrival_counters,
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    require_triton,
    round_to,
    tl,
)
from helios.kernels.gated_delta import _softplus, causal_conv_ref, check_conv

BLOCK_P = 16  # head_dim rows per program: the state tile [BLOCK_P, N] float32 stays in registers
# the chunked kernel: [MAX_CHUNK, N] B and C, [CHUNK_BLOCK_P, N] state and [MAX_CHUNK, MAX_CHUNK] scores in float32
# registers per program (N = 128: ~48 KiB at 4 warps); tl.dot tiles need >= 16
CHUNK_BLOCK_P = 16
MAX_CHUNK = 32
NUM_WARPS = 4
FLOAT32_MAX = torch.finfo(torch.float32).max  # an unbounded dt_limit (inf) as a finite kernel argument


@jit
def _dt_step(dt_raw, bias, dt_min, dt_max):
    """dt = clamp(softplus(dt + dt_bias)) in float32, the sum and the softplus rounded to dt's dtype (HF's order)."""
    dt_ty = dt_raw.dtype
    dt = (dt_raw.to(tl.float32) + bias).to(dt_ty).to(tl.float32)
    dt = _softplus(dt).to(dt_ty).to(tl.float32)
    return tl.minimum(tl.maximum(dt, dt_min), dt_max)


@jit
def _mamba2_scan_kernel(
    x_ptr,  # [T, H, P] (row stride stride_x)
    dt_ptr,  # [T, H] the dt projection, before dt_bias and softplus (row stride stride_dt)
    B_ptr,  # [T, G, N] (row stride stride_b)
    C_ptr,  # [T, G, N] (row stride stride_c)
    A_log_ptr,  # [H]
    D_ptr,  # [H]
    dt_bias_ptr,  # [H]
    state_ptr,  # [S, H, P, N] float32, in place
    out_ptr,  # [T, H, P] contiguous
    qsl_ptr,  # [B + 1]
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    stride_x, stride_dt, stride_b, stride_c,
    dt_min, dt_max,
    H: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
):
    # program (head-dim tile, head, sequence): the [BP, N] state rows of head h, carried through the sequence
    h = tl.program_id(1)
    seq = tl.program_id(2)
    op = tl.program_id(0) * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    grp = h // GROUP
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    live = (tl.zeros([BP, 1], dtype=tl.int32) + tl.load(starts_ptr + seq)) > 0  # a tile: see gated_delta's live_k
    first = tl.load(qsl_ptr + seq).to(tl.int64)  # int64 rows: row * stride never overflows
    end = tl.load(qsl_ptr + seq + 1).to(tl.int64)
    tile = state_ptr + (slot * H + h) * P * N + op[:, None] * N + on[None, :]
    tile_mask = mp[:, None] & mn[None, :]
    s = tl.load(tile, mask=tile_mask & live, other=0.0)
    A, D, bias = _head_constants(A_log_ptr, D_ptr, dt_bias_ptr, h, dt_ptr.dtype.element_ty)
    for row in tl.range(first, end):
        x = tl.load(x_ptr + row * stride_x + h * P + op, mask=mp, other=0.0).to(tl.float32)
        b = tl.load(B_ptr + row * stride_b + grp * N + on, mask=mn, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + row * stride_c + grp * N + on, mask=mn, other=0.0).to(tl.float32)
        dt = _dt_step(tl.load(dt_ptr + row * stride_dt + h), bias, dt_min, dt_max)
        s, y = _scan_step(s, x, b, c, dt, A, D)
        tl.store(out_ptr + (row * H + h) * P + op, y.to(out_ptr.dtype.element_ty), mask=mp)
    tl.store(tile, s, mask=tile_mask)


@jit
def _head_constants(A_log_ptr, D_ptr, dt_bias_ptr, h, DT_TY: tl.constexpr):
    """Head h's A = -exp(A_log), D and dt_bias (rounded to dt's dtype, as HF adds it), in float32."""
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    return A, D, tl.load(dt_bias_ptr + h).to(DT_TY).to(tl.float32)


@jit
def _scan_step(s, x, b, c, dt, A, D):
    """One token's step of a [BP, N] state tile: s = exp(dt A) s + dt x b^T; y = s c + D x."""
    s = s * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
    return s, tl.sum(s * c[None, :], axis=1) + D * x


@jit
def _conv_silu(xbc_row, w_ptr, bias_ptr, cs_row, cols, mask, start, C, K: tl.constexpr, KP: tl.constexpr,
               HAS_BIAS: tl.constexpr, DT: tl.constexpr):
    """One token's depthwise causal conv and silu over channels `cols` ([N]) as helios.kernels.gated_delta's
    _causal_conv_kernel computes it (the taps oldest first, then the bias and silu, in float32; the output rounded
    to DT as that kernel stores it), and the channels' next conv-state rows [KP, N] (rows >= K-1 unused), as its
    _conv_state_kernel writes them. A fresh sequence (start 0) reads zeros for its state."""
    live = (tl.zeros(cols.shape, dtype=tl.int32) + start) > 0  # a tile: see gated_delta's live_k
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for m in tl.static_range(K - 1):
        sv = tl.load(cs_row + m * C + cols, mask=mask & live, other=0.0).to(tl.float32)
        acc += sv * tl.load(w_ptr + cols * K + m, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(xbc_row + cols, mask=mask, other=0.0)
    acc += x.to(tl.float32) * tl.load(w_ptr + cols * K + (K - 1), mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = round_to(acc * tl.sigmoid(acc), DT)
    r = tl.arange(0, KP)[:, None]
    live2 = (tl.zeros([KP, 1], dtype=tl.int32) + start) > 0
    nxt = tl.load(cs_row + (r + 1) * C + cols[None, :], mask=(r + 1 < K - 1) & mask[None, :] & live2, other=0.0)
    return y, tl.where(r == K - 2, x.to(nxt.dtype)[None, :], nxt)


@jit
def _mamba2_decode_kernel(
    xbc_ptr,  # [B, C] the conv input x | B | C (row stride stride_xbc)
    dt_ptr,  # [B, H] (row stride stride_dt)
    conv_w_ptr,  # [C, K]
    conv_bias_ptr,  # [C] (HAS_BIAS)
    conv_state_ptr,  # [S, K-1, C], in place
    A_log_ptr, D_ptr, dt_bias_ptr,  # [H]
    state_ptr,  # [S, H, P, N] float32, in place
    out_ptr,  # [B, H, P] contiguous
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    counter_ptr,  # [>= B * G] int32, zero
    stride_xbc, stride_dt,
    dt_min, dt_max,
    C,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    K: tl.constexpr, KP: tl.constexpr, HAS_BIAS: tl.constexpr, ARRIVALS: tl.constexpr,
):
    # program (head-dim tile, head, row): the conv of its x channels and of its group's B and C, then the scan
    # step of its [BP, N] state rows. Its x channels are its own; B's and C's are every program's of the group
    # (ARRIVALS of them): each reads their conv state, the last to arrive writes it (see gated_delta's _conv_qk)
    GROUP: tl.constexpr = H // G
    h = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    op = tl.program_id(0) * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    mp = op < P
    mn = on < N
    grp = h // GROUP
    slot = tl.load(slots_ptr + row).to(tl.int64)
    start = tl.load(starts_ptr + row)
    xbc_row = xbc_ptr + row * stride_xbc
    cs_row = conv_state_ptr + slot * (K - 1) * C
    DT: tl.constexpr = xbc_ptr.dtype.element_ty
    x_cols = h * P + op
    b_cols = H * P + grp * N + on
    c_cols = H * P + G * N + grp * N + on
    x, x_next = _conv_silu(xbc_row, conv_w_ptr, conv_bias_ptr, cs_row, x_cols, mp, start, C, K, KP, HAS_BIAS, DT)
    b, b_next = _conv_silu(xbc_row, conv_w_ptr, conv_bias_ptr, cs_row, b_cols, mn, start, C, K, KP, HAS_BIAS, DT)
    c, c_next = _conv_silu(xbc_row, conv_w_ptr, conv_bias_ptr, cs_row, c_cols, mn, start, C, K, KP, HAS_BIAS, DT)
    r = tl.arange(0, KP)[:, None]
    tl.debug_barrier()  # the rows shift: every thread's conv-state loads before any store
    tl.store(cs_row + r * C + x_cols[None, :], x_next, mask=(r < K - 1) & mp[None, :])
    if ARRIVALS > 1:
        last = tl.atomic_add(counter_ptr + row * G + grp, 1, sem="acq_rel", scope="gpu") == ARRIVALS - 1
    else:
        last = True
    if last:
        bc_mask = (r < K - 1) & mn[None, :]
        tl.store(cs_row + r * C + b_cols[None, :], b_next, mask=bc_mask)
        tl.store(cs_row + r * C + c_cols[None, :], c_next, mask=bc_mask)
        if ARRIVALS > 1:
            tl.atomic_xchg(counter_ptr + row * G + grp, 0, sem="relaxed", scope="gpu")  # zero for the next launch
    # the scan step, as _mamba2_scan_kernel's
    live = (tl.zeros([BP, 1], dtype=tl.int32) + start) > 0
    tile = state_ptr + (slot * H + h) * P * N + op[:, None] * N + on[None, :]
    tile_mask = mp[:, None] & mn[None, :]
    s = tl.load(tile, mask=tile_mask & live, other=0.0)
    A, D, bias = _head_constants(A_log_ptr, D_ptr, dt_bias_ptr, h, dt_ptr.dtype.element_ty)
    dt = _dt_step(tl.load(dt_ptr + row * stride_dt + h), bias, dt_min, dt_max)
    s, y = _scan_step(s, x, b, c, dt, A, D)
    tl.store(out_ptr + (row * H + h) * P + op, y.to(out_ptr.dtype.element_ty), mask=mp)
    tl.store(tile, s, mask=tile_mask)


@jit
def _mamba2_chunk_scan_kernel(
    x_ptr, dt_ptr, B_ptr, C_ptr, A_log_ptr, D_ptr, dt_bias_ptr, state_ptr, out_ptr,  # as _mamba2_scan_kernel's
    qsl_ptr, slots_ptr, starts_ptr,
    stride_x, stride_dt, stride_b, stride_c,
    dt_min, dt_max,
    H: tl.constexpr, GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    L: tl.constexpr,
):
    # program (head-dim tile, head, sequence): the sequence's chunks in order, cut at absolute positions that are
    # multiples of L (the CPU path's grid): within a chunk y = (C B^T * decay) (dt x) + exp(cum) C S^T + D x, then
    # S <- exp(cum_last) S + (dt x * exp(cum_last - cum))^T B. Every product in float32 (ieee: no tf32).
    h = tl.program_id(1)
    seq = tl.program_id(2)
    op = tl.program_id(0) * BP + tl.arange(0, BP)
    on = tl.arange(0, BN)
    r = tl.arange(0, L)
    mp = op < P
    mn = on < N
    grp = h // GROUP
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    start = tl.load(starts_ptr + seq)
    live = (tl.zeros([BP, 1], dtype=tl.int32) + start) > 0
    length = (tl.load(qsl_ptr + seq + 1) - tl.load(qsl_ptr + seq)).to(tl.int32)
    first = tl.load(qsl_ptr + seq).to(tl.int64)  # int64 rows: row * stride never overflows
    offset = (start % L).to(tl.int32)  # the first chunk is cut short to reach the grid
    tile = state_ptr + (slot * H + h) * P * N + op[:, None] * N + on[None, :]
    tile_mask = mp[:, None] & mn[None, :]
    s = tl.load(tile, mask=tile_mask & live, other=0.0)  # [BP, BN]
    A, D, bias = _head_constants(A_log_ptr, D_ptr, dt_bias_ptr, h, dt_ptr.dtype.element_ty)
    causal = r[:, None] >= r[None, :]
    num_chunks = (offset + length + L - 1) // L
    for c in tl.range(0, num_chunks):
        lo = tl.maximum(c * L - offset, 0)
        n = tl.minimum((c + 1) * L - offset, length) - lo  # rows of this chunk
        rows = first + lo + r
        mr = r < n
        x = tl.load(x_ptr + rows[:, None] * stride_x + h * P + op[None, :], mask=mr[:, None] & mp[None, :],
                    other=0.0).to(tl.float32)  # [L, BP]
        b = tl.load(B_ptr + rows[:, None] * stride_b + grp * N + on[None, :], mask=mr[:, None] & mn[None, :],
                    other=0.0).to(tl.float32)  # [L, BN]
        cm = tl.load(C_ptr + rows[:, None] * stride_c + grp * N + on[None, :], mask=mr[:, None] & mn[None, :],
                     other=0.0).to(tl.float32)  # [L, BN]
        dt = _dt_step(tl.load(dt_ptr + rows * stride_dt + h, mask=mr, other=0.0), bias, dt_min, dt_max)
        dt = tl.where(mr, dt, 0.0)  # rows past the chunk: no decay, no write
        cum = tl.cumsum(dt * A, axis=0)  # [L] log-decay from the chunk's start through each row
        last = tl.sum(dt * A, axis=0)
        xdt = x * dt[:, None]
        decay = tl.where(causal, tl.exp(cum[:, None] - tl.where(causal, cum[None, :], 0.0)), 0.0)  # [L, L]
        scores = tl.dot(cm, tl.trans(b), input_precision="ieee") * decay
        y = tl.dot(scores, xdt, input_precision="ieee")
        y += tl.dot(cm, tl.trans(s), input_precision="ieee") * tl.exp(cum)[:, None] + D * x
        tl.store(out_ptr + (rows[:, None] * H + h) * P + op[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=mr[:, None] & mp[None, :])
        s = s * tl.exp(last) + tl.dot(tl.trans(xdt * tl.exp(last - cum)[:, None]), b, input_precision="ieee")
    tl.store(tile, s, mask=tile_mask)


def kernel_chunk(chunk_size: int | None) -> int | None:
    """The chunked kernel's chunk: the largest power of two <= MAX_CHUNK dividing the layer's chunk_size (so the
    state checkpoints and the scheduler's prefill splits land on its grid: batch- and split-invariant), None (the
    sequential kernel) when that is under 16 (tl.dot's smallest tile)."""
    if not chunk_size:
        return None
    chunk = min(MAX_CHUNK, chunk_size & -chunk_size)
    return chunk if chunk >= 16 else None


def mamba2_scan(
    x: torch.Tensor,  # [T, H, P]
    dt: torch.Tensor,  # [T, H], the dt projection (before dt_bias and softplus)
    A_log: torch.Tensor,  # [H]
    B: torch.Tensor,  # [T, G, N]
    C: torch.Tensor,  # [T, G, N]
    D: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
    state: torch.Tensor,  # [S, H, P, N] float32, in place at slots
    slots: torch.Tensor,  # [B] int32 (device)
    query_start_loc: torch.Tensor,  # [B + 1] int32 (device)
    starts: torch.Tensor,  # [B] int32 (device); 0 = fresh
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    chunk_size: int | None = None,  # the layer's; None: the sequential kernel for every batch
) -> torch.Tensor:  # [T, H, P] in x's dtype
    """Mamba-2's scan with the D skip over a varlen batch, one launch (helios.layers.recurrent.mamba2_scan's
    contract on device tensors). x, B, C and dt may be row-strided views (the conv output's and in_proj's splits).
    A decode step (T == B) takes the sequential kernel; a batch with longer sequences the chunked one when
    kernel_chunk(chunk_size) gives a chunk (else the sequential one). Both are graph-safe."""
    require_triton()
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_dim = B.shape[1:]
    num_seqs = slots.shape[0]
    assert num_heads % num_groups == 0 and C.shape == B.shape and B.shape[0] == num_tokens
    assert dt.shape == (num_tokens, num_heads), f"dt {tuple(dt.shape)} vs {num_tokens} tokens, {num_heads} heads"
    assert A_log.shape == D.shape == dt_bias.shape == (num_heads,)
    assert state.dtype == torch.float32 and state.is_contiguous(), "state must be contiguous float32"
    assert state.shape[1:] == (num_heads, head_dim, state_dim), \
        f"state {tuple(state.shape)} must be [S, H={num_heads}, P={head_dim}, N={state_dim}]"
    assert query_start_loc.shape == (num_seqs + 1,) and starts.shape == (num_seqs,)
    assert not slots.dtype.is_floating_point and not starts.dtype.is_floating_point
    for name, t in (("x", x), ("B", B), ("C", C)):
        check_last_dim_contiguous(name, t)
        assert t.stride(1) == t.shape[2], f"{name}: heads / groups must be packed within a row"
    check_last_dim_contiguous("dt", dt)
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    chunk = kernel_chunk(chunk_size) if num_tokens > num_seqs else None
    block_p = min(BLOCK_P if chunk is None else CHUNK_BLOCK_P, max(16, next_power_of_2(head_dim)))
    kernel, extra = (_mamba2_scan_kernel, {}) if chunk is None else (_mamba2_chunk_scan_kernel, dict(L=chunk))
    kernel[(-(-head_dim // block_p), num_heads, num_seqs)](
        x, dt, B, C, A_log, D, dt_bias, state, out, query_start_loc, slots, starts,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        float(dt_limit[0]), min(float(dt_limit[1]), FLOAT32_MAX),
        H=num_heads, GROUP=num_heads // num_groups, P=head_dim, N=state_dim, BP=block_p,
        BN=max(16, next_power_of_2(state_dim)), num_warps=NUM_WARPS, **extra,
    )
    return out


def mamba2_decode(
    xbc: torch.Tensor,  # [B, C] the conv input: x [H*P] | B [G*N] | C [G*N] per row (in_proj's split)
    dt: torch.Tensor,  # [B, H], the dt projection (before dt_bias and softplus)
    conv_weight: torch.Tensor,  # [C, K]
    conv_bias: torch.Tensor | None,  # [C]
    conv_state: torch.Tensor,  # [S, K-1, C], in place at slots
    A_log: torch.Tensor,  # [H]
    D: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H]
    state: torch.Tensor,  # [S, H, P, N] float32, in place at slots
    slots: torch.Tensor,  # [B] (device)
    starts: torch.Tensor,  # [B] (device); 0 = fresh
    num_groups: int,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
) -> torch.Tensor:  # [B, H, P] in xbc's dtype
    """A decode step (one token per sequence) of the Mamba-2 mixer from the conv input, in one launch: the causal
    conv with silu (gated_delta.causal_conv's two launches) and mamba2_scan's step, the same values. Graph-safe."""
    require_triton()
    num_rows, channels = xbc.shape
    num_heads, head_dim, state_dim = state.shape[1:]
    width = conv_weight.shape[1]
    assert channels == num_heads * head_dim + 2 * num_groups * state_dim and num_heads % num_groups == 0
    check_conv(conv_weight, conv_state, conv_state.shape[0], channels)
    assert conv_bias is None or (conv_bias.shape == (channels,) and conv_bias.is_contiguous())
    assert dt.shape == (num_rows, num_heads) and A_log.shape == D.shape == dt_bias.shape == (num_heads,)
    assert state.dtype == torch.float32 and state.is_contiguous(), "state must be contiguous float32"
    assert slots.shape == starts.shape == (num_rows,)
    assert not slots.dtype.is_floating_point and not starts.dtype.is_floating_point
    check_last_dim_contiguous("xbc", xbc)
    check_last_dim_contiguous("dt", dt)
    out = torch.empty(num_rows, num_heads, head_dim, dtype=xbc.dtype, device=xbc.device)
    if num_rows == 0:
        return out
    block_p = min(BLOCK_P, max(16, next_power_of_2(head_dim)))
    num_tiles = -(-head_dim // block_p)
    arrivals = num_tiles * (num_heads // num_groups)
    assert arrivals == 1 or num_rows * num_groups <= COUNTER_SLOTS, "more (row, group) pairs than arrival counters"
    counters = arrival_counters(xbc.device, "mamba2_decode") if arrivals > 1 else slots
    _mamba2_decode_kernel[(num_tiles, num_heads, num_rows)](
        xbc, dt, conv_weight, conv_bias if conv_bias is not None else conv_weight, conv_state, A_log, D, dt_bias,
        state, out, slots, starts, counters, xbc.stride(0), dt.stride(0),
        float(dt_limit[0]), min(float(dt_limit[1]), FLOAT32_MAX), channels,
        H=num_heads, G=num_groups, P=head_dim, N=state_dim, BP=block_p, BN=max(16, next_power_of_2(state_dim)),
        K=width, KP=next_power_of_2(width - 1), HAS_BIAS=conv_bias is not None, ARRIVALS=arrivals,
        num_warps=NUM_WARPS,
    )
    return out


def mamba2_decode_ref(xbc, dt, conv_weight, conv_bias, conv_state, A_log, D, dt_bias, state, slots, starts,
                      num_groups, dt_limit=(0.0, float("inf"))):
    """causal_conv_ref (silu) then mamba2_scan_ref, one row per sequence."""
    num_rows = xbc.shape[0]
    num_heads, head_dim, state_dim = state.shape[1:]
    qsl = torch.arange(num_rows + 1, device=xbc.device)
    y = causal_conv_ref(xbc, conv_weight, conv_state, slots, qsl, starts, bias=conv_bias)
    xs, b, c = y.split([num_heads * head_dim, num_groups * state_dim, num_groups * state_dim], dim=-1)
    return mamba2_scan_ref(xs.reshape(num_rows, num_heads, head_dim), dt, A_log,
                           b.reshape(num_rows, num_groups, state_dim), c.reshape(num_rows, num_groups, state_dim), D,
                           dt_bias, state, slots, qsl, starts, dt_limit)


def mamba2_scan_ref(x, dt, A_log, B, C, D, dt_bias, state, slots, query_start_loc, starts,
                    dt_limit=(0.0, float("inf"))):
    """Token by token in float32 (the decode step of transformers' NemotronHMamba2Mixer.torch_forward, per
    sequence from state[slot], zeros when fresh); dt + dt_bias and the softplus rounded to dt's dtype."""
    group = x.shape[1] // B.shape[1]
    dt = torch.nn.functional.softplus((dt + dt_bias.to(dt.dtype)).float()).to(dt.dtype).float()
    dt = dt.clamp(min=dt_limit[0], max=dt_limit[1])  # [T, H]
    A = -A_log.float().exp()
    skip = D.float()[:, None]
    xf = x.float()
    bf, cf = B.float().repeat_interleave(group, 1), C.float().repeat_interleave(group, 1)  # [T, H, N]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    qsl, start_list = query_start_loc.tolist(), starts.tolist()
    for i, slot in enumerate(slots.tolist()):
        s = state[slot].clone() if start_list[i] > 0 else state.new_zeros(state.shape[1:])
        for t in range(qsl[i], qsl[i + 1]):
            s = s * (dt[t] * A).exp()[:, None, None] + (xf[t] * dt[t][:, None])[:, :, None] * bf[t][:, None, :]
            out[t] = ((s * cf[t][:, None, :]).sum(-1) + skip * xf[t]).to(out.dtype)
        state[slot] = s
    return out
