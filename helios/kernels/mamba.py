"""Mamba-2's selective scan (nemotron_h) on the GPU: one slot-indexed varlen kernel for decode and prefill alike.

Batch layout as helios.kernels.gated_delta's (sequence i: rows query_start_loc[i]:query_start_loc[i+1], first
position starts[i], 0 = fresh: the slot is never read, slots[i]: its state row, read and written in place). State
[S, H, P, N] float32 (HF's [heads, head_dim, state_dim]). Head h reads B and C of group h // (H / G).
Per token: dt = clamp(softplus(dt + dt_bias)) (the sum and the softplus rounded to dt's dtype, as HF), S <- exp(dt A)
S + dt x B^T, y = S C + D x, A = -exp(A_log). The kernel walks each sequence's tokens in order with its state tile
in registers, all in float32: the recurrent form, so its bits depend on neither the batch nor where the scheduler
split a prompt (the CPU path's chunked form agrees to rounding). Graph-safe: device-side bounds, no host sync,
a grid fixed by the shapes (one program row per sequence: a decode step is T == B).
NOTE: a sequential scan. Prefill costs one dependent step per token (no chunked SSD): fine for decode and short
prompts, the place to add a chunked kernel when long Mamba-2 prompts matter.
Imports torch and helios.kernels._triton / gated_delta; nothing else.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl
from helios.kernels.gated_delta import _softplus

BLOCK_P = 16  # head_dim rows per program: the state tile [BLOCK_P, N] float32 stays in registers
NUM_WARPS = 4
FLOAT32_MAX = torch.finfo(torch.float32).max  # an unbounded dt_limit (inf) as a finite kernel argument


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
        dt = (tl.load(dt_ptr + row * stride_dt + h).to(tl.float32) + bias).to(dt_ty).to(tl.float32)
        dt = _softplus(dt).to(dt_ty).to(tl.float32)
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
        s = s * tl.exp(dt * A) + (x * dt)[:, None] * b[None, :]
        y = tl.sum(s * c[None, :], axis=1) + D * x
        tl.store(out_ptr + (row * H + h) * P + op, y.to(out_ptr.dtype.element_ty), mask=mp)
    tl.store(tile, s, mask=tile_mask)


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
) -> torch.Tensor:  # [T, H, P] in x's dtype
    """Mamba-2's scan with the D skip over a varlen batch, one launch (helios.layers.recurrent.mamba2_scan's
    contract on device tensors). x, B, C and dt may be row-strided views (the conv output's and in_proj's splits)."""
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
    block_p = min(BLOCK_P, next_power_of_2(head_dim))
    _mamba2_scan_kernel[(-(-head_dim // block_p), num_heads, num_seqs)](
        x, dt, B, C, A_log, D, dt_bias, state, out, query_start_loc, slots, starts,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0),
        float(dt_limit[0]), min(float(dt_limit[1]), FLOAT32_MAX),
        H=num_heads, GROUP=num_heads // num_groups, P=head_dim, N=state_dim, BP=block_p,
        BN=next_power_of_2(state_dim), num_warps=NUM_WARPS,
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
