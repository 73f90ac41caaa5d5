"""The per-head attention output gate o * sigmoid(g)[head] (step3p7: one gate per head, broadcast over its
head_dim values) in one launch, where torch launches sigmoid and mul. The torch path's roundings kept, as
helios.kernels.output_gate's: sigmoid in float32 rounded to the gate's dtype, then the product rounded once.
Imports torch and helios.kernels._triton only.
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
def _head_gate_kernel(
    o_ptr,  # [num_tokens, num_heads * head_dim] (row stride stride_o)
    g_ptr,  # [num_tokens, num_heads] (row stride stride_g)
    out_ptr,  # [num_tokens, num_heads * head_dim] contiguous
    stride_o,
    stride_g,
    width,  # num_heads * head_dim
    head_dim,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    o = tl.load(o_ptr + t * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_g + cols // head_dim, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = round_to(1.0 / (1.0 + tl.exp(-g)), dtype)  # torch.sigmoid's output tensor
    tl.store(out_ptr + t * width + cols, round_to(o * gate, dtype).to(dtype), mask=mask)


def sigmoid_head_gate(
    o: torch.Tensor,  # [num_tokens, num_heads * head_dim]
    g: torch.Tensor,  # [num_tokens, num_heads], the gate (before its sigmoid), o's dtype
) -> torch.Tensor:  # [num_tokens, num_heads * head_dim] contiguous, o's dtype
    """o * sigmoid(g) per head, as two eager torch ops compute it; o and g may be row-strided views."""
    require_triton()
    assert o.dim() == 2 and g.dim() == 2 and g.shape[0] == o.shape[0] and g.dtype == o.dtype, (
        f"o {tuple(o.shape)} {o.dtype}, g {tuple(g.shape)} {g.dtype}")
    num_tokens, width = o.shape
    num_heads = g.shape[1]
    assert width % num_heads == 0, f"o's {width} values are not num_heads={num_heads} heads"
    check_last_dim_contiguous("o", o)
    check_last_dim_contiguous("g", g)
    out = torch.empty(num_tokens, width, dtype=o.dtype, device=o.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(o, num_tokens)
    _head_gate_kernel[(num_tokens, cdiv(width, _BLOCK))](o, g, out, o.stride(0), g.stride(0), width,
                                                         width // num_heads, BLOCK=_BLOCK, USE_PDL=pdl,
                                                         num_warps=4, launch_pdl=pdl)
    return out


def sigmoid_head_gate_ref(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """helios.layers.attention's gate_per_head branch."""
    num_tokens, num_heads = g.shape
    return (o.view(num_tokens, num_heads, -1) * torch.sigmoid(g)[:, :, None]).view(num_tokens, -1)
