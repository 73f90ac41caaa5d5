"""Kimi delta attention (KDA: kimi_linear, glm5_next) on the GPU: the slot-indexed fused decode step and the chunked
prefill through flash-linear-attention's chunk_kda (fla-core, imported on first use only).

Batch layout, state layout ([S, H, dk, dv] float32, in place by slot), the conv, split programs and graph-safety are
helios.kernels.gated_delta's: the decode step is its fused step specialised to KDA (one value head per key head, a
decay per key channel), from f = f_b(f_a(x)) [B, H*dk] (or f_a and f_b's weight: each program makes its head's f):
kimi_linear's g = -exp(A_log) softplus(f + dt_bias), or glm5_next's safe gate
g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)); beta = sigmoid(b). q, k, v and the state share one head count.
The layer's gated output norm (RMSNorm * sigmoid(g_b(g_a(x)))) may run in the same launch (GatedOutputNorm).
Imports torch, helios.kernels.gated_delta / _triton and (lazily, prefill only) fla; nothing else.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

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
from helios.kernels.gated_delta import (
    NUM_STAGES,
    NUM_WARPS,
    _check_state,
    _conv_qk,
    _conv_step,
    _l2norm_scaled,
    _softplus_kimi,
    _splits,
    _tile_args,
    causal_conv_ref,
    check_conv,
    chunked_by_slot,
    gated_delta_rule_ref,
    recurrent_step,
)

FLA_CHUNK_SIZES = (32, 64)  # chunk_kda's
FOLD_BLOCK = 32  # f_b's / g_b's input columns per step of a folded product ([d, 32] weight tiles in registers)
# the step's state tiles [dk, 32]: the GDN step took 64 columns (gated_delta.BLOCK_V, timed on the H100); this one, with
# the folds' weight tiles beside, is not timed at 64
STATE_COLUMNS = 32


class GatedOutputNorm(NamedTuple):
    """KDA's output norm, folded into the decode launch: per head, RMSNorm(o) times `weight` in float32, times
    sigmoid(z) with z = z_weight[head * dv:(head + 1) * dv] @ z_in[row] (float32 sums rounded to z_in's dtype, as
    g_b's own product rounds it): helios.kernels.gated_norm's kimi order on g_b's output."""

    z_in: torch.Tensor  # [B, dz] g_a(x)
    z_weight: torch.Tensor  # [H*dv, dz] g_b's weight
    weight: torch.Tensor  # [dv]
    eps: float


@jit
def _kda_decode_kernel(
    x_ptr,  # [B, C] conv input: q [H*DK] | k [H*DK] | v [H*DV]
    conv_w_ptr,  # [C, K]
    conv_state_ptr,  # [S, K-1, C], in place
    f_ptr,  # FOLD: f_a [B, DF]; else f [B, H*DK]
    f_w_ptr,  # [H*DK, DF] f_b's weight (FOLD)
    b_ptr,  # [B, H] raw: beta = sigmoid(b)
    A_log_ptr,  # [H]
    dt_bias_ptr,  # [H*DK]
    state_ptr,  # [S, H, DK, DV] float32, in place
    out_ptr,  # [B, H, DV] contiguous
    slots_ptr,  # [B]
    starts_ptr,  # [B]
    counter_ptr,  # [>= B * H] int32, zero (SPLIT > 1); NORM: [>= 2 * B * H]
    z_ptr,  # [B, DZ] the output gate's projection input (NORM)
    zw_ptr,  # [H*DV, DZ] its weight (NORM)
    nw_ptr,  # [DV] the norm's weight (NORM)
    gate_ptr,  # [B, H, DV] float32 scratch: each program's columns' sigmoid(z), for the norm's program (NORM)
    stride_x, stride_f, stride_b, stride_z,
    C,
    scale,
    lower_bound,  # SAFE_GATE: g = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
    eps,  # NORM
    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    SPLIT: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, DF: tl.constexpr, BF: tl.constexpr, FB: tl.constexpr,
    FOLD: tl.constexpr, SAFE_GATE: tl.constexpr, USE_PDL: tl.constexpr,
    NORM: tl.constexpr, DZ: tl.constexpr, BZ: tl.constexpr, BDV: tl.constexpr,
):
    # program (split, head, row): the head's q, k and gate, then TILES [DK, BV] state tiles (columns t * BV); NORM:
    # each program also makes its columns' output gates, and the last of the head's programs to finish its tiles
    # normalizes the head's output in place (a short tail: the g_b product is spread over the head's programs)
    NV: tl.constexpr = (DV + BV - 1) // BV
    TILES: tl.constexpr = NV // SPLIT
    split = tl.program_id(0)
    h = tl.program_id(1)
    row = tl.program_id(2).to(tl.int64)
    ok = tl.arange(0, BK)
    ov = tl.arange(0, BV)
    mk = ok < DK
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    start = tl.load(starts_ptr + row)
    live_k = (tl.zeros([BK, 1], dtype=tl.int32) + start) > 0  # as tiles: a scalar mask term trips the interpreter
    x_row = x_ptr + row * stride_x
    cs_row = conv_state_ptr + slot * (K - 1) * C
    live_c = (tl.zeros([KP, 1], dtype=tl.int32) + start) > 0
    r = tl.arange(0, KP)[:, None]
    q, k = _conv_qk(x_row, conv_w_ptr, conv_w_ptr, cs_row, counter_ptr, row * HK + h, h * DK + ok,
                    (HK + h) * DK + ok, mk, live_c, C, K, KP, False, True, SPLIT)
    q = _l2norm_scaled(q, scale)
    k = _l2norm_scaled(k, 1.0)
    if FOLD:  # f = f_b.weight[h*DK:(h+1)*DK] @ f_a in float32, rounded to f_a's dtype as f_b's product would be
        f = tl.zeros([BK], dtype=tl.float32)
        for j0 in tl.static_range(0, BF, FB):
            j = j0 + tl.arange(0, FB)
            mj = j < DF
            f_a = tl.load(f_ptr + row * stride_f + j, mask=mj, other=0.0).to(tl.float32)
            w = tl.load(f_w_ptr + (h * DK + ok)[:, None] * DF + j[None, :], mask=mk[:, None] & mj[None, :],
                        other=0.0).to(tl.float32)
            f += tl.sum(w * f_a[None, :], axis=1)
        f = f.to(f_ptr.dtype.element_ty).to(tl.float32)
    else:
        f = tl.load(f_ptr + row * stride_f + h * DK + ok, mask=mk, other=0.0).to(tl.float32)
    f += tl.load(dt_bias_ptr + h * DK + ok, mask=mk, other=0.0).to(tl.float32)
    rate = tl.exp(tl.load(A_log_ptr + h).to(tl.float32))
    if SAFE_GATE:
        g = lower_bound * tl.sigmoid(rate * f)
    else:
        g = -rate * _softplus_kimi(f)
    decay = tl.exp(g)[:, None]  # [BK, 1]
    beta = tl.sigmoid(tl.load(b_ptr + row * stride_b + h).to(tl.float32))
    for t in tl.range(split * TILES, split * TILES + TILES):
        cols = t * BV + ov
        mv = cols < DV
        tile = state_ptr + (slot * HK + h) * DK * DV + ok[:, None] * DV + cols[None, :]
        tile_mask = mk[:, None] & mv[None, :]
        v, v_next = _conv_step(x_row, conv_w_ptr, conv_w_ptr, cs_row, 2 * HK * DK + h * DV + cols, mv, live_c, C, K,
                               KP, False, True)
        tl.debug_barrier()  # this tile's channels are this program's alone; its rows shift as above
        tl.store(cs_row + r * C + (2 * HK * DK + h * DV + cols)[None, :], v_next, mask=(r < K - 1) & mv[None, :])
        s = tl.load(tile, mask=tile_mask & live_k, other=0.0) * decay
        delta = (v - tl.sum(s * k[:, None], axis=0)) * beta
        s += k[:, None] * delta[None, :]
        tl.store(tile, s, mask=tile_mask)
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + (row * HK + h) * DV + cols, o.to(out_ptr.dtype.element_ty), mask=mv)
        if NORM:
            z = _gate_projection(z_ptr + row * stride_z, zw_ptr + h * DV * DZ, cols, mv, DZ, BZ, BV)
            tl.store(gate_ptr + (row * HK + h) * DV + cols, 1.0 / (1.0 + tl.exp(-z)), mask=mv)
    if NORM:
        # NOTE: every thread's output stores precede the barrier, the barrier the release; the last program's
        # acquire then sees every split's stores (the split-K semaphore pattern)
        tl.debug_barrier()
        last = True
        if SPLIT > 1:
            done = counter_ptr + (tl.num_programs(2) + row) * HK + h  # past the q/k counters
            last = tl.atomic_add(done, 1, sem="acq_rel", scope="gpu") == SPLIT - 1
        if last:
            _gated_output_norm(out_ptr + (row * HK + h) * DV, gate_ptr + (row * HK + h) * DV, nw_ptr, eps, DV, BDV)
            if SPLIT > 1:
                tl.atomic_xchg(done, 0, sem="relaxed", scope="gpu")  # zero for the next launch


@jit
def _gate_projection(z_row, zw_rows, cols, mask, DZ: tl.constexpr, BZ: tl.constexpr, N: tl.constexpr):
    """z = zw_rows[cols] [N, DZ] @ z_row [DZ] in float32, rounded to z_row's dtype (as the projection's own launch
    rounds its output)."""
    z = tl.zeros([N], dtype=tl.float32)
    for j0 in tl.static_range(0, DZ, BZ):
        j = j0 + tl.arange(0, BZ)
        mj = j < DZ
        z_in = tl.load(z_row + j, mask=mj, other=0.0).to(tl.float32)
        zw = tl.load(zw_rows + cols[:, None] * DZ + j[None, :], mask=mask[:, None] & mj[None, :],
                     other=0.0).to(tl.float32)
        z += tl.sum(zw * z_in[None, :], axis=1)
    return z.to(z_row.dtype.element_ty).to(tl.float32)


@jit
def _gated_output_norm(o_row, gate_row, nw_ptr, eps, DV: tl.constexpr, BDV: tl.constexpr):
    """One head's output [DV] in place: gated_norm's kimi order (norm, float32 weight, * the stored gate)."""
    cols = tl.arange(0, BDV)
    mask = cols < DV
    x = tl.load(o_row + cols, mask=mask, other=0.0)
    h = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / DV + eps)
    h = tl.load(nw_ptr + cols, mask=mask, other=0.0).to(tl.float32) * (h * rstd)
    tl.store(o_row + cols, (h * tl.load(gate_row + cols, mask=mask, other=0.0)).to(x.dtype), mask=mask)


def kda_decode(
    mixed_qkv: torch.Tensor,  # [B, C] the conv input rows: q [H*dk] | k [H*dk] | v [H*dv]
    conv_weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, K-1, C], in place
    f: torch.Tensor,  # [B, H*dk] the forget gate's projection f_b(f_a(x)); with f_b_weight: f_a(x) [B, df]
    b: torch.Tensor,  # [B, H] the b projection: beta = sigmoid(b)
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H*dk]
    state: torch.Tensor,  # [S, H, dk, dv] float32, in place
    slots: torch.Tensor,  # [B] int32 (device)
    starts: torch.Tensor,  # [B] int32 (device); 0 = fresh
    lower_bound: float | None = None,  # glm5_next's safe gate; None: kimi_linear's softplus gate
    num_splits: int | None = None,
    f_b_weight: torch.Tensor | None = None,  # [H*dk, df]: f is f_a, and each program makes its head's f
    output_norm: GatedOutputNorm | None = None,
) -> torch.Tensor:  # [B, H, dv] in mixed_qkv's dtype
    """One decode token per sequence, one launch: the conv step (+ silu) and its conv-state update, q/k l2norm, the
    per-channel gate and beta, the delta-rule update of state[slot] and its output (gated_delta_decode's step, one
    value head per key head). With f_b_weight the launch also makes f = f_a f_b^T (float32 sums, rounded to f_a's
    dtype as f_b's own product is), one head's [dk, df] slice per program: f_b's launch folded in (batch-1 decode
    counts launches). With output_norm the output comes normalized and gated (GatedOutputNorm), the norm's launch and
    g_b's folded in too: each program makes its own columns' gates (a float32 scratch), and the last of a head's split
    programs to finish (an arrival counter) reads the head's stored output and gates back and normalizes the output
    in place (the norm kernel's roundings). The first call with num_splits > 1 allocates the arrival counters: not
    inside a graph capture."""
    require_triton()
    num_rows, channels = mixed_qkv.shape
    num_slots, num_heads, dk, dv = state.shape
    check_conv(conv_weight, conv_state, num_slots, channels)
    assert channels == num_heads * (2 * dk + dv), f"C={channels} vs H={num_heads}, dk={dk}, dv={dv}"
    if f_b_weight is None:
        assert f.shape == (num_rows, num_heads * dk), f"f {tuple(f.shape)} vs [{num_rows}, {num_heads * dk}]"
    else:
        assert f.dim() == 2 and f.shape[0] == num_rows and f_b_weight.shape == (num_heads * dk, f.shape[1])
        assert f_b_weight.is_contiguous() and f_b_weight.dtype == f.dtype, "f_b_weight: contiguous, f_a's dtype"
    assert b.shape == (num_rows, num_heads)
    assert A_log.numel() == num_heads and dt_bias.numel() == num_heads * dk
    assert A_log.is_contiguous() and dt_bias.is_contiguous()
    assert lower_bound is None or lower_bound < 0, f"lower_bound {lower_bound} must be negative"
    _check_state(state, slots, starts, num_rows, num_heads)
    for name, t in (("mixed_qkv", mixed_qkv), ("f", f), ("b", b)):
        check_last_dim_contiguous(name, t)
    z_in = z_weight = norm_weight = None
    if output_norm is not None:
        z_in, z_weight, norm_weight, _ = output_norm
        assert z_in.dim() == 2 and z_in.shape[0] == num_rows and z_weight.shape == (num_heads * dv, z_in.shape[1])
        assert z_weight.is_contiguous() and z_weight.dtype == z_in.dtype, "z_weight: contiguous, z_in's dtype"
        assert norm_weight.shape == (dv,) and norm_weight.is_contiguous()
        check_last_dim_contiguous("z_in", z_in)
    out = torch.empty(num_rows, num_heads, dv, dtype=mixed_qkv.dtype, device=mixed_qkv.device)
    if num_rows == 0:
        return out
    splits = _splits(num_rows, num_heads, state, num_splits, STATE_COLUMNS)
    counters = None
    if splits > 1:
        groups = num_rows * num_heads * (2 if output_norm is not None else 1)
        assert groups <= COUNTER_SLOTS, "more (row, head) groups than arrival counters"
        counters = arrival_counters(mixed_qkv.device, "kda")
    width = conv_weight.shape[1]
    tiles = _tile_args(num_heads, state, splits, STATE_COLUMNS)
    fold_cols = f.shape[1] if f_b_weight is not None else 1
    z_cols = z_in.shape[1] if z_in is not None else 1
    pdl = use_pdl(mixed_qkv, num_rows)
    _kda_decode_kernel[(splits, num_heads, num_rows)](
        mixed_qkv, conv_weight, conv_state, f, f_b_weight if f_b_weight is not None else f, b, A_log, dt_bias, state,
        out, slots, starts, counters, *((z_in, z_weight, norm_weight) if output_norm is not None else (f, f, f)),
        torch.empty(out.shape, dtype=torch.float32, device=out.device) if output_norm is not None else out,
        mixed_qkv.stride(0), f.stride(0), b.stride(0), z_in.stride(0) if z_in is not None else 0, channels,
        dk**-0.5, 0.0 if lower_bound is None else float(lower_bound),
        float(output_norm.eps) if output_norm is not None else 0.0,
        HK=num_heads, DK=dk, DV=dv, BK=tiles["BK"], BV=tiles["BV"], SPLIT=splits, K=width,
        KP=next_power_of_2(width - 1), DF=fold_cols, BF=next_power_of_2(fold_cols),
        FB=min(FOLD_BLOCK, next_power_of_2(fold_cols)), FOLD=f_b_weight is not None,
        SAFE_GATE=lower_bound is not None, USE_PDL=pdl, NORM=output_norm is not None, DZ=z_cols,
        BZ=min(FOLD_BLOCK, next_power_of_2(z_cols)), BDV=next_power_of_2(dv),
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, launch_pdl=pdl,
    )
    return out


def kda_rule(
    q: torch.Tensor,  # [T, H, dk]
    k: torch.Tensor,  # [T, H, dk]
    v: torch.Tensor,  # [T, H, dv]
    g: torch.Tensor,  # [T, H, dk] float32 log-decay of each key channel
    beta: torch.Tensor,  # [T, H]
    state: torch.Tensor,  # [S, H, dk, dv] float32, in place
    slots: torch.Tensor,  # [B]
    query_start_loc: torch.Tensor,  # [B + 1]
    starts: torch.Tensor,  # [B]
    chunk_size: int = 64,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    cu_seqlens: tuple[torch.Tensor, torch.Tensor] | None = None,
    all_fresh: bool = False,
    qk_normalized: bool = False,
) -> torch.Tensor:  # [T, H, dv] in q's dtype
    """The Kimi delta rule over a varlen batch; q/k l2-normalised inside (eps 1e-6), q scaled by dk**-0.5.
    cu_seqlens, all_fresh and qk_normalized: as gated_delta_rule takes them.

    T == B: the slot-indexed one-token kernel (graph-safe). Otherwise fla's chunk_kda (CUDA only, not graph-safe)
    on the states gathered by slot, as gated_delta_rule does. fla chunks at 32 or 64 only; another chunk_size takes
    64 (exact algebra either way; only the rounding differs from the CPU path's grid).
    safe_gate: fla's bounded-gate path (gates in [lower_bound, 0), lower_bound in [-5, 0): bf16x3 tensor-core dots
    on the diagonal blocks). Off by default: transformers calls chunk_kda without it, and the plain path keeps its
    intra-chunk products in float32."""
    num_tokens, num_heads, dk = q.shape
    assert k.shape == q.shape and v.shape[:2] == (num_tokens, num_heads)
    assert g.shape == (num_tokens, num_heads, dk) and g.dtype == torch.float32 and g.is_contiguous()
    assert beta.shape == (num_tokens, num_heads)
    assert state.shape[2:] == (dk, v.shape[2]), f"state {tuple(state.shape)} vs dk={dk}, dv={v.shape[2]}"
    num_seqs = slots.shape[0]
    _check_state(state, slots, starts, num_seqs, num_heads)
    for name, t in (("q", q), ("k", k), ("v", v), ("beta", beta)):
        check_last_dim_contiguous(name, t)
    if num_tokens == num_seqs:
        require_triton()
        assert not qk_normalized, "the one-token kernel normalizes q and k itself"
        return recurrent_step(q, k, v, g, beta, state, slots, starts)
    # meta: benchmarks/decode_launches.py counts a prompt step's launches
    assert q.is_cuda or q.is_meta, "the chunked prefill runs fla's kernels: CUDA only (the CPU path: the torch ref)"
    from fla.ops.kda import chunk_kda

    if safe_gate:
        assert lower_bound is not None and -5 <= lower_bound < 0, "fla's safe gate needs lower_bound in [-5, 0)"
    chunk_fn = functools.partial(chunk_kda, safe_gate=safe_gate, lower_bound=lower_bound if safe_gate else None)
    chunk = chunk_size if chunk_size in FLA_CHUNK_SIZES else 64
    return chunked_by_slot(chunk_fn, q, k, v, g, beta, state, slots, query_start_loc, starts, chunk, cu_seqlens,
                           all_fresh, qk_normalized)


# --- torch references ----------------------------------------------------------------------------------------


def kda_gates_ref(f, b, A_log, dt_bias, lower_bound=None):  # -> g [T, H, dk] float32, beta [T, H] float32
    """KDA's per-channel gate in float32 (transformers' KimiLinearForgetGate / Glm5NextTextForgetGate)."""
    num_heads = A_log.numel()
    x = (f.float() + dt_bias.float()).view(f.shape[0], num_heads, -1)
    rate = A_log.float().reshape(num_heads, 1).exp()
    if lower_bound is not None:
        g = lower_bound * torch.sigmoid(rate * x)
    else:
        g = -rate * torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(x)))
    return g, b.float().sigmoid()


def gated_output_norm_ref(o: torch.Tensor, norm: GatedOutputNorm) -> torch.Tensor:  # [B, H, dv] in o's dtype
    """GatedOutputNorm in torch: z rounded to z_in's dtype, the rest in float32, one rounding to o's dtype."""
    z = torch.nn.functional.linear(norm.z_in.float(), norm.z_weight.float()).to(norm.z_in.dtype)
    h = o.float()
    h = norm.weight.float() * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + norm.eps))
    return (h * torch.sigmoid(z.float().view(o.shape))).to(o.dtype)


def kda_decode_ref(mixed_qkv, conv_weight, conv_state, f, b, A_log, dt_bias, state, slots, starts,
                   lower_bound=None, num_splits=None, f_b_weight=None, output_norm=None):
    """causal_conv_ref (silu), kda_gates_ref, then gated_delta_rule_ref with the per-channel decay; with f_b_weight,
    f = f_b's product of f (f_a) first, in float32 and rounded to f's dtype; with output_norm, gated_output_norm_ref
    of the output."""
    if output_norm is not None:
        o = kda_decode_ref(mixed_qkv, conv_weight, conv_state, f, b, A_log, dt_bias, state, slots, starts,
                           lower_bound, f_b_weight=f_b_weight)
        return gated_output_norm_ref(o, output_norm)
    if f_b_weight is not None:
        f = torch.nn.functional.linear(f.float(), f_b_weight.float()).to(f.dtype)
    num_rows = mixed_qkv.shape[0]
    _, num_heads, dk, dv = state.shape
    qsl = torch.arange(num_rows + 1, dtype=torch.int32)
    y = causal_conv_ref(mixed_qkv, conv_weight, conv_state, slots, qsl, starts)
    q, k, v = y.split([num_heads * dk, num_heads * dk, num_heads * dv], dim=-1)
    g, beta = kda_gates_ref(f, b, A_log, dt_bias, lower_bound)
    return gated_delta_rule_ref(q.reshape(num_rows, num_heads, dk), k.reshape(num_rows, num_heads, dk),
                                v.reshape(num_rows, num_heads, dv), g, beta, state, slots, qsl, starts)
