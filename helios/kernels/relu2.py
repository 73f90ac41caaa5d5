"""relu(x)^2 (HF's ReLUSquaredActivation: nemotron_h's MLP and shared expert) in one launch, where torch launches
relu and square. Bit-equal to helios.layers.moe.relu2: relu is exact and square rounds the float32 product to x's
dtype once, as here. Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    cdiv,
    check_last_dim_contiguous,
    jit,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    round_to,
    tl,
    use_pdl,
)

_BLOCK = 1024


@jit
def _relu2_kernel(
    x_ptr,  # [num_tokens, F] (row stride stride_x)
    out_ptr,  # [num_tokens, F] contiguous
    stride_x,
    width,  # F
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + t * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = tl.where(x < 0.0, 0.0, x)  # NaN passes, as torch's relu
    y = round_to(r * r, out_ptr.dtype.element_ty)  # to nearest even, in the interpreter too
    tl.store(out_ptr + t * width + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def relu2(x: torch.Tensor) -> torch.Tensor:  # [num_tokens, F] -> [num_tokens, F] contiguous, x's dtype
    require_triton()
    assert x.dim() == 2, f"expected [num_tokens, F], got {tuple(x.shape)}"
    check_last_dim_contiguous("x", x)
    num_tokens, width = x.shape
    out = torch.empty(num_tokens, width, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(x, num_tokens)
    _relu2_kernel[(num_tokens, cdiv(width, _BLOCK))](x, out, x.stride(0), width, BLOCK=_BLOCK, USE_PDL=pdl,
                                                    num_warps=4, launch_pdl=pdl)
    return out


def relu2_ref(x: torch.Tensor) -> torch.Tensor:
    return torch.square(torch.relu(x))
