"""Gated activations over a fused [gate | up] row (gate first): silu_and_mul and gelu_tanh_and_mul, with
helios.layers.activation.gated's clamps (limit: before or after the act) and SwiGLU-OAI (alpha).

Numerics follow helios.layers.activation (HF): every value the torch path holds in the input dtype (act(gate),
each clamp, gate * alpha, ...) is rounded to it here too (round_to), so a 16-bit row gives the torch path's bits.
Imports torch and helios.kernels._triton only.
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

_BLOCK = 1024


@jit
def _gated_kernel(
    x_ptr,  # [num_tokens, 2 * F]
    out_ptr,  # [num_tokens, F] contiguous
    stride_x,
    width,  # F
    limit,  # the clamp's bound (CLAMP != 0)
    alpha,  # SwiGLU-OAI's gain (HAS_ALPHA)
    IS_GELU_TANH: tl.constexpr,
    CLAMP: tl.constexpr,  # 0 none, 1 gate <= limit and |up| <= limit, 2 act(gate) <= limit and |up| <= limit
    HAS_ALPHA: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    # NOTE: a clamp of a 16-bit tensor by a float bound is min / max then one rounding, as torch's clamp
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
    require_triton()
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [num_tokens, 2*F], got {tuple(x.shape)}"
    check_last_dim_contiguous("x", x)
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, cdiv(width, _BLOCK))
    pdl = use_pdl(x, num_tokens)
    clamp = 0 if limit is None else (2 if clamp_after_act else 1)
    _gated_kernel[grid](x, out, x.stride(0), width, float(limit or 0.0), float(alpha or 0.0),
                        IS_GELU_TANH=is_gelu_tanh, CLAMP=clamp, HAS_ALPHA=alpha is not None, BLOCK=_BLOCK,
                        USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def silu_and_mul(x: torch.Tensor, limit: float | None = None, clamp_after_act: bool = False,
                 alpha: float | None = None) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, False, limit, clamp_after_act, alpha)


def gelu_tanh_and_mul(x: torch.Tensor, limit: float | None = None, clamp_after_act: bool = False,
                      alpha: float | None = None) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, True, limit, clamp_after_act, alpha)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
