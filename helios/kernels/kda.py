"""Kimi delta attention (KDA: kimi_linear, glm5_next) on the GPU: the slot-indexed fused decode step and the chunked
prefill through flash-linear-attention's chunk_kda (fla-core, imported on first use only).

Batch layout, state layout ([S, H, dk, dv] float32, in place by slot), the conv and graph-safety are
helios.kernels.gated_delta's: the decode step is its kernel with the decay per key channel (PER_CHANNEL), from
f = f_b(f_a(x)) [B, H*dk]: kimi_linear's g = -exp(A_log) softplus(f + dt_bias), or glm5_next's safe gate
g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)); beta = sigmoid(b). q, k, v and the state share one head count.
Imports torch, helios.kernels.gated_delta / _triton and (lazily, prefill only) fla; nothing else.
"""

from __future__ import annotations

import functools

import torch

from helios.kernels._triton import check_last_dim_contiguous, require_triton
from helios.kernels.gated_delta import (
    _check_state,
    causal_conv_ref,
    check_conv,
    chunked_by_slot,
    fused_delta_step,
    gated_delta_rule_ref,
    recurrent_step,
)

FLA_CHUNK_SIZES = (32, 64)  # chunk_kda's


def kda_decode(
    mixed_qkv: torch.Tensor,  # [B, C] the conv input rows: q [H*dk] | k [H*dk] | v [H*dv]
    conv_weight: torch.Tensor,  # [C, K]
    conv_state: torch.Tensor,  # [S, K-1, C], in place
    f: torch.Tensor,  # [B, H*dk] the forget gate's projection f_b(f_a(x))
    b: torch.Tensor,  # [B, H] the b projection: beta = sigmoid(b)
    A_log: torch.Tensor,  # [H]
    dt_bias: torch.Tensor,  # [H*dk]
    state: torch.Tensor,  # [S, H, dk, dv] float32, in place
    slots: torch.Tensor,  # [B] int32 (device)
    starts: torch.Tensor,  # [B] int32 (device); 0 = fresh
    lower_bound: float | None = None,  # glm5_next's safe gate; None: kimi_linear's softplus gate
    num_splits: int | None = None,
) -> torch.Tensor:  # [B, H, dv] in mixed_qkv's dtype
    """One decode token per sequence, one launch: the conv step (+ silu) and its conv-state update, q/k l2norm, the
    per-channel gate and beta, the delta-rule update of state[slot] and its output (gated_delta_decode's kernel).
    The first call with num_splits > 1 allocates the arrival counters: not inside a graph capture."""
    require_triton()
    num_rows, channels = mixed_qkv.shape
    num_slots, num_heads, dk, dv = state.shape
    check_conv(conv_weight, conv_state, num_slots, channels)
    assert channels == num_heads * (2 * dk + dv), f"C={channels} vs H={num_heads}, dk={dk}, dv={dv}"
    assert f.shape == (num_rows, num_heads * dk) and b.shape == (num_rows, num_heads)
    assert A_log.numel() == num_heads and dt_bias.numel() == num_heads * dk
    assert A_log.is_contiguous() and dt_bias.is_contiguous()
    assert lower_bound is None or lower_bound < 0, f"lower_bound {lower_bound} must be negative"
    _check_state(state, slots, starts, num_rows, num_heads)
    for name, t in (("mixed_qkv", mixed_qkv), ("f", f), ("b", b)):
        check_last_dim_contiguous(name, t)
    return fused_delta_step(mixed_qkv, conv_weight, conv_state, f, b, A_log, dt_bias, state, slots, starts,
                            num_heads, num_splits=num_splits, per_channel=True, lower_bound=lower_bound)


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
) -> torch.Tensor:  # [T, H, dv] in q's dtype
    """The Kimi delta rule over a varlen batch; q/k l2-normalised inside (eps 1e-6), q scaled by dk**-0.5.

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
        return recurrent_step(q, k, v, g, beta, state, slots, starts)
    assert q.is_cuda, "the chunked prefill runs fla's kernels: CUDA only (the CPU path is the torch reference)"
    from fla.ops.kda import chunk_kda

    if safe_gate:
        assert lower_bound is not None and -5 <= lower_bound < 0, "fla's safe gate needs lower_bound in [-5, 0)"
    chunk_fn = functools.partial(chunk_kda, safe_gate=safe_gate, lower_bound=lower_bound if safe_gate else None)
    chunk = chunk_size if chunk_size in FLA_CHUNK_SIZES else 64
    return chunked_by_slot(chunk_fn, q, k, v, g, beta, state, slots, query_start_loc, starts, chunk)


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


def kda_decode_ref(mixed_qkv, conv_weight, conv_state, f, b, A_log, dt_bias, state, slots, starts,
                   lower_bound=None, num_splits=None):
    """causal_conv_ref (silu), kda_gates_ref, then gated_delta_rule_ref with the per-channel decay."""
    num_rows = mixed_qkv.shape[0]
    _, num_heads, dk, dv = state.shape
    qsl = torch.arange(num_rows + 1, dtype=torch.int32)
    y = causal_conv_ref(mixed_qkv, conv_weight, conv_state, slots, qsl, starts)
    q, k, v = y.split([num_heads * dk, num_heads * dk, num_heads * dv], dim=-1)
    g, beta = kda_gates_ref(f, b, A_log, dt_bias, lower_bound)
    return gated_delta_rule_ref(q.reshape(num_rows, num_heads, dk), k.reshape(num_rows, num_heads, dk),
                                v.reshape(num_rows, num_heads, dv), g, beta, state, slots, qsl, starts)
