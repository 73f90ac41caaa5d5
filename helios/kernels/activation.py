"""Gated activations over a fused [gate | up] row (gate first): silu_and_mul and gelu_tanh_and_mul.

Numerics follow helios.layers.activation (HF): act(gate) is rounded to the input dtype before the
multiply by up, as two eager torch ops would round it. Imports torch and helios.kernels._triton only.
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
    IS_GELU_TANH: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    gate = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0)
    up = tl.load(x_ptr + t * stride_x + width + cols, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    if IS_GELU_TANH:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)  # sqrt(2/pi) (x + 0.044715 x^3)
        act = 0.5 * g * (1.0 + tanh(inner))
    else:
        act = g / (1.0 + tl.exp(-g))
    y = act.to(gate.dtype).to(tl.float32) * up
    tl.store(out_ptr + t * width + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, is_gelu_tanh: bool) -> torch.Tensor:
    require_triton()
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"expected [num_tokens, 2*F], got {tuple(x.shape)}"
    check_last_dim_contiguous("x", x)
    num_tokens, width = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    grid = (num_tokens, cdiv(width, _BLOCK))
    pdl = use_pdl(x, num_tokens)
    _gated_kernel[grid](x, out, x.stride(0), width, IS_GELU_TANH=is_gelu_tanh, BLOCK=_BLOCK, USE_PDL=pdl,
                        num_warps=4, launch_pdl=pdl)
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, False)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, 2*F] -> [num_tokens, F]
    return _launch(x, True)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
