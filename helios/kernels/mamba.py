"""Mamba-2's selective scan (nemotron_h) on the GPU: slot-indexed varlen kernels for decode and prefill.

Batch layout as helios.kernels.gated_delta's (sequence i: rows query_start_loc[i]:query_start_loc[i+1], first
position starts[i], 0 = fresh: the slot is never read, slots[i]: its state row, read and written in place). State
[S, H, P, N] float32 (HF's [heads, head_dim, state_dim]). Head h reads B and C of group h // (H / G).
Per token: dt = clamp(softplus(dt + dt_bias)) (the sum and the softplus rounded to dt's dtype, as HF), S <- exp(dt A)
S + dt x B^T, y = S C + D x, A = -exp(A_log). Two kernels, each walking a sequence in order with its state tile in
float32 registers: the sequential one token by token (decode steps, and prefill where the layer's chunk is under
16), the chunked one a chunk at a time (SSD's form with float32 ieee products), its chunks cut at absolute multiples
of a divisor of the layer's chunk_size, as the CPU path's: a sequence's bits depend neither on its batch nor on
where the scheduler split its prompt. Graph-safe: device-side bounds, no host sync, a grid fixed by the shapes.
Imports torch and helios.kernels._triton / gated_delta; nothing else.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.gated_delta import _softplus

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
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_ty = dt_ptr.dtype.element_ty
    bias = tl.load(dt_bias_ptr + h).to(dt_ty).to(tl.float32)
    for row in tl.range(first, end):
        x = tl.load(x_ptr + row * stride_x + h * P + op, mask=mp, other=0.0).to(tl.float32)
        b = tl.load(B_ptr + row * stride_b + grp * N + on, mask=mn, other=0.0).to(tl.float32)
        c = tl.load(C_ptr + row * stride_c + grp * N + on, mask=mn, other=0.0).to(tl.float32)
        dt = _dt_step(tl.load(dt_ptr + row * stride_dt + h), bias, dt_min, dt_max)
        s = s * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
        y = tl.sum(s * c[None, :], axis=1) + D * x
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
    A = -tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    D = tl.load(D_ptr + h).to(tl.float32)
    dt_ty = dt_ptr.dtype.element_ty
    bias = tl.load(dt_bias_ptr + h).to(dt_ty).to(tl.float32)
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
