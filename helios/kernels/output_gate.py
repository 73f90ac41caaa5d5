"""The attention output gate o * sigmoid(g) in one launch, where torch launches sigmoid and mul: a gate per channel
(qwen3_5 / qwen3_next's gated attention) or per head, broadcast over its head_dim values (step3p7). The torch path's roundings kept: sigmoid in float32 rounded to the gate's dtype, then the
float32 product rounded once. Imports torch and helios.kernels._triton only.
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
def _sigmoid_gate_kernel(
    o_ptr,  # [num_tokens, F] (row stride stride_o)
    g_ptr,  # [num_tokens, F / group] (row stride stride_g)
    out_ptr,  # [num_tokens, F] contiguous
    stride_o,
    stride_g,
    width,  # F
    group,  # channels per gate: 1, or head_dim
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    o = tl.load(o_ptr + t * stride_o + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + t * stride_g + cols // group, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    gate = round_to(1.0 / (1.0 + tl.exp(-g)), dtype)  # torch.sigmoid's output tensor
    tl.store(out_ptr + t * width + cols, round_to(o * gate, dtype).to(dtype), mask=mask)


def sigmoid_gate(
    o: torch.Tensor,  # [num_tokens, F]
    g: torch.Tensor,  # [num_tokens, F] or [num_tokens, num_heads]: the gate (before its sigmoid), o's dtype
) -> torch.Tensor:  # [num_tokens, F] contiguous, o's dtype
    """o * sigmoid(g), as two eager torch ops compute it, g per channel or per head (F = num_heads * head_dim);
    o and g may be row-strided views."""
    require_triton()
    assert o.dim() == 2 and g.dim() == 2 and g.shape[0] == o.shape[0] and g.dtype == o.dtype, (
        f"o {tuple(o.shape)} {o.dtype}, g {tuple(g.shape)} {g.dtype}")
    assert o.shape[1] % g.shape[1] == 0, f"o's {o.shape[1]} values are not {g.shape[1]} gated groups"
    check_last_dim_contiguous("o", o)
    check_last_dim_contiguous("g", g)
    num_tokens, width = o.shape
    out = torch.empty(num_tokens, width, dtype=o.dtype, device=o.device)
    if num_tokens == 0:
        return out
    pdl = use_pdl(o, num_tokens)
    _sigmoid_gate_kernel[(num_tokens, cdiv(width, _BLOCK))](o, g, out, o.stride(0), g.stride(0), width,
                                                           width // g.shape[1], BLOCK=_BLOCK, USE_PDL=pdl, num_warps=4, launch_pdl=pdl)
    return out


def sigmoid_gate_ref(o: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """helios.layers.attention's gate branches: per channel, or per head (g [T, num_heads])."""
    if g.shape == o.shape:
        return o * torch.sigmoid(g)
    num_tokens, num_heads = g.shape
    return (o.view(num_tokens, num_heads, -1) * torch.sigmoid(g)[:, :, None]).view(num_tokens, -1)
