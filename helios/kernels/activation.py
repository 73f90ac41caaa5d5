"""Gated activations over a fused [gate | up] row (gate first): silu_and_mul and gelu_tanh_and_mul, with
helios.layers.activation.gated's clamps (limit: before or after the act) and SwiGLU-OAI (alpha); act_and_mul
takes gate and up as two tensors (gemma4's per-layer-input gate).

Numerics follow helios.layers.activation (HF): every value the torch path holds in the input dtype (act(gate),
each clamp, gate * alpha, ...) is rounded to it here too, so a 16-bit row gives the torch path's bits; the plain
act(gate) * up is the down GEMV's fold (gemv._gated), value for value. Imports torch and helios.kernels only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    jit,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tanh,
    tl,
    use_pdl,
)
from helios.kernels.gemv import _gated as _gemv_gated

_BLOCK = 1024


@jit
def _gated_kernel(
    gate_ptr,  # [num_tokens, F] rows may be strided (the first half of a [gate | up] row)
    up_ptr,  # [num_tokens, F] rows may be strided
    out_ptr,  # [num_tokens, F] contiguous
    stride_g,
    stride_u,
    width,  # F
    limit,  # the clamp's bound (CLAMP != 0)
    alpha,  # SwiGLU-OAI's gain (HAS_ALPHA)
    IS_GELU_TANH: tl.constexpr,
    CLAMP: tl.constexpr,  # 0 none, 1 gate <= limit and |up| <= limit, 2 act(gate) <= limit and |up| <= limit
    HAS_ALPHA: tl.constexpr,
    AS_GEMV: tl.constexpr,  # the plain product of a [gate | up] row, computed as the down GEMV's fold
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    gate = tl.load(gate_ptr + t * stride_g + cols, mask=mask, other=0.0)
    up = tl.load(up_ptr + t * stride_u + cols, mask=mask, other=0.0)
    if AS_GEMV:
        # NOTE: the down GEMV's own fold (gemv._gated), so a batch-1 step and a wider one see the same values
        y = _gemv_gated(gate, up, 2 if IS_GELU_TANH else 1).to(tl.float32)
    else:
        g = gate.to(tl.float32)
        u = up.to(tl.float32)
        # a clamp of a 16-bit tensor by a float bound is min / max then one rounding, as torch's clamp
        if CLAMP == 1:
            g = round_to(tl.minimum(g, limit), DT)
        if CLAMP != 0:
            u = round_to(tl.minimum(tl.maximum(u, -limit), limit), DT)
        if HAS_ALPHA:
            # (up + 1) * (gate * sigmoid(gate * alpha)), each product of the torch path rounded where it is
            sig = round_to(1.0 / (1.0 + tl.exp(-round_to(g * alpha, DT))), DT)
            y = round_to(u + 1.0, DT) * round_to(g * sig, DT)
        else:
            if IS_GELU_TANH:
                # torch's GeluKernel order: x^3 = (x * x) * x, sqrt(2/pi) (x + 0.044715 x^3), (0.5 x) (1 + tanh)
                inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
                act = 0.5 * g * (1.0 + tanh(inner))
            else:
                act = g / (1.0 + tl.exp(-g))
            act = round_to(act, DT)
            if CLAMP == 2:
                act = round_to(tl.minimum(act, limit), DT)
            y = act * u
    tl.store(out_ptr + t * width + cols, round_to(y, DT).to(DT), mask=mask)


def _launch(x: torch.Tensor, is_gelu_tanh: bool, limit: float | None, clamp_after_act: bool,
            alpha: float | None) -> torch.Tensor:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [num_tokens, 2*F], got {tuple(x.shape)}"
    width = x.shape[1] // 2
    return _launch_pair(x[:, :width], x[:, width:], is_gelu_tanh, limit, clamp_after_act, alpha,
                        as_gemv=limit is None and alpha is None)


def _launch_pair(gate: torch.Tensor, up: torch.Tensor, is_gelu_tanh: bool, limit: float | None = None,
                 clamp_after_act: bool = False, alpha: float | None = None, as_gemv: bool = False) -> torch.Tensor:
    require_triton()
    assert gate.dim() == 2 and gate.shape == up.shape and gate.dtype == up.dtype, (
        f"expected gate and up [num_tokens, F] alike: {tuple(gate.shape)} {gate.dtype}, {tuple(up.shape)} {up.dtype}")
    check_last_dim_contiguous("gate", gate)
    check_last_dim_contiguous("up", up)
    num_tokens, width = gate.shape
    out = torch.empty(num_tokens, width, dtype=gate.dtype, device=gate.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, cdiv(width, _BLOCK))
    pdl = use_pdl(gate, num_tokens)
    clamp = 0 if limit is None else (2 if clamp_after_act else 1)
    _gated_kernel[grid](gate, up, out, gate.stride(0), up.stride(0), width, float(limit or 0.0), float(alpha or 0.0),
                        IS_GELU_TANH=is_gelu_tanh, CLAMP=clamp, HAS_ALPHA=alpha is not None, AS_GEMV=as_gemv,
                        BLOCK=_BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def silu_and_mul(x: torch.Tensor, limit: float | None = None, clamp_after_act: bool = False,
                 alpha: float | None = None) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, False, limit, clamp_after_act, alpha)


def gelu_tanh_and_mul(x: torch.Tensor, limit: float | None = None, clamp_after_act: bool = False,
                      alpha: float | None = None) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, True, limit, clamp_after_act, alpha)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:  # 2 x [T, F] -> [T, F]
    """act(gate) * up ("silu" or "gelu_tanh") of two tensors whose rows may be strided."""
    assert act in ("silu", "gelu_tanh"), act
    return _launch_pair(gate, up, act == "gelu_tanh")


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
