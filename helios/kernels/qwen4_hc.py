"""qwen4_exp's gated-residual hyper-connections for the GPU path: the ~40 torch kernels and three projections around
each sublayer as two launches, graph-safe (no host sync, buffers sized from shapes). `hc_mix`: `_norm_mix_kernel`
(per block of tokens, of projection rows and stream: the previous sublayer's output added to the streams, the
stream's RMS, its normed values and their products with the down and inject projections' rows), then
`_gate_mix_kernel` (per block of tokens and of H: the streams' shares summed in stream order, silu, the up
projection, the sigmoid gates and the mean over the streams; the first block also the injection weights). Every rounding of the torch path (16-bit
tensors between its ops) is taken at the same place (round_to); a token's values come from its own row in an order
fixed by the shapes, never the batch. Imports torch and helios.kernels._triton only; `hc_mix_ref` is the torch path
helios.layers.hyper_connections runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helios.kernels._triton import (
    cdiv,
    interpret_mode,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tl,
    use_pdl,
)

# NOTE: a program's products are tl.dot tiles of BLOCK_T tokens (the tensor cores' 16 rows; masked at batch 1): a
# token's row of an MMA never depends on the other rows, and the tile shapes are fixed, so its sums never depend on
# the batch; a prefill reads each weight once per 16 tokens, not per token.
BLOCK_T = 16
BLOCK_K = 128  # a stream's columns per step of the norm and of the down / inject products
BLOCK_N = 16  # projection rows per norm-mix program (down's R, then inject's S)
BLOCK_H = 32  # hidden columns per gate-mix program (times S streams of the up projection's rows)
BLOCK_R = 32  # low-rank columns per step of the up projection


@jit
def _streams(x_ptr, y_ptr, w_ptr, rows, row_mask, ks, k_mask, g, H, stride_x, stride_y,
             S: tl.constexpr, HAS_ADD: tl.constexpr, DT: tl.constexpr):
    """[BLOCK_T, BLOCK_K] float32: stream g's columns ks of x, plus weights[:, g] * y (each rounded to DT, as
    add_to_streams' two ops) with HAS_ADD."""
    mask = row_mask[:, None] & k_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + g * H + ks[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ADD:
        y = tl.load(y_ptr + rows[:, None] * stride_y + ks[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + rows * S + g, mask=row_mask, other=0.0).to(tl.float32)
        x = round_to(x + round_to(y * w[:, None], DT), DT)
    return x


@jit
def _norm_mix_kernel(
    x_ptr,  # [T, S*H] the streams, rows strided
    y_ptr,  # [T, H] the previous sublayer's output, rows strided (HAS_ADD)
    w_ptr,  # [T, S] its injection weights, contiguous (HAS_ADD)
    x_out_ptr,  # [T, S*H] contiguous out: the streams after the add (HAS_ADD)
    norm_ptr,  # [S*H] the grouped norm's weight (multiplied in float32)
    down_ptr,  # [R, S*H] the down projection, rows strided
    inject_ptr,  # [S, S*H] the inject projection, rows strided (HAS_INJECT)
    normed_ptr,  # [T, S*H] contiguous out: the normed streams in x's dtype
    partial_ptr,  # [T, S, N_PAD] float32 out: stream g's share of each projection row (down's R, then inject's S)
    num_tokens,
    H,
    R,
    stride_x,
    stride_y,
    stride_down,
    stride_inject,
    eps,
    S: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_ADD: tl.constexpr,
    HAS_INJECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,  # the products' operands as float32 (exact): float32 streams, or the interpreter
    USE_PDL: tl.constexpr,
):
    """Program (block of tokens, block of projection rows, stream g): g's RMS factor, then its normed columns' products
    with BLOCK_N rows. Each program also writes the normed values (and the added streams) of every num_programs(1)-th
    step of columns, so each column is written once."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    n_block = tl.program_id(1)
    g = tl.program_id(2)
    row_mask = rows < num_tokens
    dt = normed_ptr.dtype.element_ty
    ns = n_block * BLOCK_N + tl.arange(0, BLOCK_N)
    num_rows = R + S if HAS_INJECT else R
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    squares = tl.zeros([BLOCK_T], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        x = _streams(x_ptr, y_ptr, w_ptr, rows, row_mask, ks, ks < H, g, H, stride_x, stride_y, S, HAS_ADD, dt)
        squares += tl.sum(x * x, axis=1)
    r = 1.0 / tl.sqrt_rn(squares / H + eps)  # torch.rsqrt(mean + eps)
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        x = _streams(x_ptr, y_ptr, w_ptr, rows, row_mask, ks, k_mask, g, H, stride_x, stride_y, S, HAS_ADD, dt)
        nw = tl.load(norm_ptr + g * H + ks, mask=k_mask, other=0.0).to(tl.float32)
        normed = round_to(x * r[:, None] * nw[None, :], dt)
        if (k0 // BLOCK_K) % tl.num_programs(1) == n_block:
            out = rows[:, None] * (S * H) + g * H + ks[None, :]
            mask = row_mask[:, None] & k_mask[None, :]
            tl.store(normed_ptr + out, normed.to(dt), mask=mask)
            if HAS_ADD:
                tl.store(x_out_ptr + out, x.to(dt), mask=mask)
        cols = g * H + ks[None, :]
        w = tl.load(down_ptr + ns[:, None] * stride_down + cols, mask=(ns < R)[:, None] & k_mask[None, :], other=0.0)
        if HAS_INJECT:
            inject_rows = ns - R
            in_inject = (ns >= R) & (inject_rows < S)
            w += tl.load(inject_ptr + inject_rows[:, None] * stride_inject + cols,
                         mask=in_inject[:, None] & k_mask[None, :], other=0.0)  # + 0: exact
        a = normed.to(dt)  # exact: already rounded to dt
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    out = partial_ptr + (rows[:, None] * S + g) * N_PAD + ns[None, :]
    tl.store(out, acc, mask=row_mask[:, None] & (ns < num_rows)[None, :])


@jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@jit
def _projected(partial_ptr, rows, row_mask, cols, col_mask, S: tl.constexpr, N_PAD: tl.constexpr, DT: tl.constexpr):
    """[BLOCK_T, len(cols)] a projection's outputs: the streams' shares summed in stream order, rounded to DT."""
    mask = row_mask[:, None] & col_mask[None, :]
    total = tl.load(partial_ptr + rows[:, None] * S * N_PAD + cols[None, :], mask=mask, other=0.0)
    for g in tl.static_range(1, S):
        total += tl.load(partial_ptr + (rows[:, None] * S + g) * N_PAD + cols[None, :], mask=mask, other=0.0)
    return round_to(total, DT)


@jit
def _gate_mix_kernel(
    normed_ptr,  # [T, S*H] (_norm_mix_kernel's)
    partial_ptr,  # [T, S, N_PAD] float32 (_norm_mix_kernel's)
    up_ptr,  # [S*H, R] the up projection, rows strided
    out_ptr,  # [T, H] out: the sublayer's input, the normed streams' dtype
    weights_ptr,  # [T, S] out: the injection weights (HAS_INJECT)
    num_tokens,
    H,
    R,
    stride_up,
    S: tl.constexpr,
    S_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_INJECT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_F32: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (block of tokens, block of H): the up projection's rows of every stream for these columns (S_PAD *
    BLOCK_H rows, stream-major), the gates, their products with the normed streams, the mean over the streams."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_mask = rows < num_tokens
    j = tl.arange(0, S_PAD * BLOCK_H)
    stream = j // BLOCK_H
    hs = tl.program_id(1) * BLOCK_H + j % BLOCK_H
    col_mask = (stream < S) & (hs < H)
    dt = out_ptr.dtype.element_ty
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    acc = tl.zeros([BLOCK_T, S_PAD * BLOCK_H], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        rs = r0 + tl.arange(0, BLOCK_R)
        r_mask = rs < R
        # silu(down(normed) / S): the projection, the quotient and the activation each rounded to the dtype
        d = round_to(_projected(partial_ptr, rows, row_mask, rs, r_mask, S, N_PAD, dt) / S, dt)
        a = round_to(d / (1.0 + tl.exp(-d)), dt)
        w = tl.load(up_ptr + (stream * H + hs)[:, None] * stride_up + rs[None, :],
                    mask=col_mask[:, None] & r_mask[None, :], other=0.0)  # [S_PAD * BLOCK_H, BLOCK_R]
        a = a.to(w.dtype)  # exact: already rounded to dt
        if DOT_F32:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    mask = row_mask[:, None] & col_mask[None, :]
    gates = round_to(_sigmoid(round_to(acc, dt)), dt)
    normed = tl.load(normed_ptr + rows[:, None] * (S * H) + (stream * H + hs)[None, :], mask=mask,
                     other=0.0).to(tl.float32)
    products = tl.reshape(round_to(gates * normed, dt), [BLOCK_T, S_PAD, BLOCK_H])
    # the mean over the streams, summed in stream order
    streams = tl.arange(0, S_PAD)
    total = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for m in tl.static_range(S):
        total += tl.sum(tl.where(streams[None, :, None] == m, products, 0.0), axis=1)
    h_out = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    tl.store(out_ptr + rows[:, None] * H + h_out[None, :], round_to(total / S, dt).to(dt),
             mask=row_mask[:, None] & (h_out < H)[None, :])
    if HAS_INJECT:
        if tl.program_id(1) == 0:
            v = round_to(_projected(partial_ptr, rows, row_mask, R + streams, streams < S, S, N_PAD, dt) / S, dt)
            v = round_to(2.0 * round_to(_sigmoid(v), dt), dt)
            tl.store(weights_ptr + rows[:, None] * S + streams[None, :], v.to(dt),
                     mask=row_mask[:, None] & (streams < S)[None, :])


def hc_mix(
    x: torch.Tensor,  # [T, S*H] the residual streams, rows strided
    norm_weight: torch.Tensor,  # [S*H] the grouped norm's (multiplied in float32)
    down_weight: torch.Tensor,  # [R, S*H]
    up_weight: torch.Tensor,  # [S*H, R]
    inject_weight: torch.Tensor | None,  # [S, S*H]; None: hc_head (no injection weights)
    num_streams: int,
    eps: float,
    residual: tuple[torch.Tensor, torch.Tensor] | None = None,  # (y [T, H], weights [T, S]) added to x first
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:  # (sublayer input [T, H], weights [T, S], streams)
    """hc_mix_ref in two launches: the sublayer's input, its injection weights (None without inject_weight) and the
    streams the sublayer's output is later added to (x itself without `residual`), each in x's dtype."""
    require_triton()
    t, width = x.shape
    s = num_streams
    h = width // s
    rank = down_weight.shape[0]
    assert width == s * h and x.stride(1) == 1, f"streams [T, S*H], got {tuple(x.shape)}"
    assert norm_weight.shape == (width,) and norm_weight.is_contiguous()
    assert down_weight.shape == (rank, width) and down_weight.stride(1) == 1, f"down {tuple(down_weight.shape)}"
    assert up_weight.shape == (width, rank) and up_weight.stride(1) == 1, f"up {tuple(up_weight.shape)}"
    assert inject_weight is None or (inject_weight.shape == (s, width) and inject_weight.stride(1) == 1)
    assert all(w is None or w.dtype == x.dtype for w in (down_weight, up_weight, inject_weight)), \
        "the projections in the streams' dtype (their products on the tensor cores)"
    out = torch.empty(t, h, dtype=x.dtype, device=x.device)
    weights = torch.empty(t, s, dtype=x.dtype, device=x.device) if inject_weight is not None else None
    streams = x
    if residual is not None:
        y, w = residual
        assert y.shape == (t, h) and y.dtype == x.dtype and y.stride(1) == 1, f"y {tuple(y.shape)} {y.dtype}"
        assert w.shape == (t, s) and w.dtype == x.dtype and w.is_contiguous(), f"weights {tuple(w.shape)}"
        streams = torch.empty(t, width, dtype=x.dtype, device=x.device)
    if t == 0:
        return out, weights, streams
    y, w = residual if residual is not None else (x, x)  # unread without HAS_ADD
    num_rows = rank + (s if inject_weight is not None else 0)
    n_pad = next_power_of_2(rank + s)
    normed = torch.empty(t, width, dtype=x.dtype, device=x.device)
    partials = torch.empty(t, s, n_pad, dtype=torch.float32, device=x.device)
    inject = inject_weight if inject_weight is not None else down_weight
    # NOTE: float32 is a test/debug dtype: its products stay IEEE float32 rather than TF32. The interpreter's tl.dot
    # of 16-bit operands is wrong (Triton 3.9), so there they go in as float32: the same exact products, the same sums.
    dot_f32 = x.dtype == torch.float32 or interpret_mode()
    # NOTE: no FMA contraction in the mix kernel: x + w * y is two roundings in torch, in float32 too (on the H200 the
    # contracted form gave other float32 bits for the added streams, session 17)
    precision = "ieee" if dot_f32 else "tf32"
    pdl = use_pdl(x, t)
    _norm_mix_kernel[(cdiv(t, BLOCK_T), cdiv(num_rows, BLOCK_N), s)](
        x, y, w, streams, norm_weight, down_weight, inject, normed, partials, t, h, rank, x.stride(0), y.stride(0),
        down_weight.stride(0), inject.stride(0), eps, S=s, N_PAD=n_pad, BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K,
        BLOCK_N=BLOCK_N, HAS_ADD=residual is not None, HAS_INJECT=inject_weight is not None, DOT_PRECISION=precision,
        DOT_F32=dot_f32, USE_PDL=pdl, num_warps=4, launch_pdl=pdl, enable_fp_fusion=False)
    block_h = min(BLOCK_H, max(16, next_power_of_2(h)))
    _gate_mix_kernel[(cdiv(t, BLOCK_T), cdiv(h, block_h))](
        normed, partials, up_weight, out, weights if weights is not None else out, t, h, rank, up_weight.stride(0),
        S=s, S_PAD=max(2, next_power_of_2(s)), N_PAD=n_pad, BLOCK_T=BLOCK_T, BLOCK_H=block_h, BLOCK_R=BLOCK_R,
        HAS_INJECT=inject_weight is not None, DOT_PRECISION=precision, DOT_F32=dot_f32, USE_PDL=pdl, num_warps=4,
        launch_pdl=pdl)
    return out, weights, streams


# --- the torch path (helios.layers.hyper_connections runs it off the GPU path) ---------------------------------------


def _sigmoid_ref(x: torch.Tensor) -> torch.Tensor:
    """helios.layers.recurrent.sigmoid: 1 / (1 + exp(-x)) in float32, cast back (the same bits at every offset)."""
    return (1.0 / (1.0 + torch.exp(-x.to(torch.float32)))).to(x.dtype)


def _silu_ref(x: torch.Tensor) -> torch.Tensor:
    """helios.layers.recurrent.silu: x / (1 + exp(-x)) in float32, cast back."""
    h = x.to(torch.float32)
    return (h / (1.0 + torch.exp(-h))).to(x.dtype)


def add_to_streams_ref(
    x: torch.Tensor,  # [T, S*H] the residual streams
    y: torch.Tensor,  # [T, H] a sublayer's output
    weights: torch.Tensor,  # [T, S] its injection weights
) -> torch.Tensor:  # [T, S*H]
    """Stream s += weights[:, s] * y (HF: hyper_input + (y[..., None, :] * w[..., None]).flatten(-2))."""
    return x + (y[:, None, :] * weights[:, :, None]).flatten(1)


def grouped_rms_norm_ref(
    x: torch.Tensor,  # [T, S*H]
    weight: torch.Tensor,  # [S*H] (zero-centred, stored 1+w), multiplied in float32
    num_groups: int,
    eps: float,
) -> torch.Tensor:  # [T, S*H]
    """RMSNorm of each of the S groups of H channels on its own (HF's Qwen4ExpTextRMSNorm with group_size=H), as
    helios.layers.norm.rms_norm with multiply_in_float32."""
    h = x.view(x.shape[0], num_groups, -1).to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * weight.view(num_groups, -1).to(torch.float32)).to(x.dtype).view(x.shape)


def hc_mix_ref(x, norm_weight, down_weight, up_weight, inject_weight, num_streams, eps, residual=None,
               linear=F.linear):
    """hc_mix in torch, as Qwen4ExpTextGatedResidual (the residual added first, as add_to_streams_ref); `linear` is
    the layers' projection. NOTE: recurrent's silu and sigmoid (exp-based), whose bits do not depend on a row's place
    in the batch."""
    if residual is not None:
        x = add_to_streams_ref(x, *residual)
    s = num_streams
    normed = grouped_rms_norm_ref(x, norm_weight, s, eps)
    gates = _sigmoid_ref(linear(_silu_ref(linear(normed, down_weight) / s), up_weight))  # [T, S*H]
    mixed = (gates * normed).view(x.shape[0], s, -1).mean(dim=1)
    if inject_weight is None:
        return mixed, None, x
    return mixed, 2 * _sigmoid_ref(linear(normed, inject_weight) / s), x
