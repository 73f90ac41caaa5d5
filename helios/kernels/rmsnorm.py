"""RMSNorm and RMSNorm fused with the residual add, one program per row, float32 statistics.

Numerics follow helios.layers.norm (HF): y = x * rsqrt(mean(x^2) + eps) * w with the statistics in float32;
llama/qwen round the normalized value to the input dtype before the weight multiply, gemma multiplies in
float32 (`multiply_in_float32`). The fused variant first forms residual = x + residual in x.dtype (the one
rounding torch's add does) and normalizes that. Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import (
    check_last_dim_contiguous,
    jit,
    next_power_of_2,
    pdl_launch_dependents,
    pdl_wait,
    require_triton,
    tl,
    use_pdl,
)

# warps of a program over a row of 2048-4096 (a decode step's norms at batch 1: latency; gpu_decode.py tries others)
WIDE_ROW_WARPS = 8


@jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, dim] (rows addressed as (i, j) of a 2- or 3-d tensor)
    residual_ptr,  # [num_rows, dim], read only with HAS_RESIDUAL
    weight_ptr,  # [dim]
    out_ptr,  # [num_rows, dim] contiguous
    residual_out_ptr,  # [num_rows, dim] contiguous, written only with HAS_RESIDUAL
    inner_rows,  # size of the second leading dimension (1 for a 2-d input)
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i = row // inner_rows
    j = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * dim + cols, x, mask=mask)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / dim
    h = h * tl.rsqrt(mean_square + eps)
    if MULTIPLY_IN_FLOAT32:
        y = h * w
    else:
        # HF: weight * h.to(input_dtype); the float32 product of two 16-bit floats is exact, so one
        # rounding below reproduces torch's 16-bit multiply bit for bit.
        y = h.to(x.dtype).to(tl.float32) * w
    tl.store(out_ptr + row * dim + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@jit
def _sum_squares_kernel(x_ptr, out_ptr, dim, num_parts, PARTS: tl.constexpr, CHUNK: tl.constexpr,
                        USE_PDL: tl.constexpr):
    p = tl.arange(0, PARTS)
    idx = p[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]  # [PARTS, CHUNK]
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    h = tl.load(x_ptr + idx, mask=(idx < dim) & (p < num_parts)[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + p, tl.sum(h * h, axis=1), mask=p < num_parts)


def row_sum_squares(x: torch.Tensor, num_parts: int = 1) -> torch.Tensor:  # [1, dim] -> [num_parts] float32
    """A row's float32 sum of squares in `num_parts` partials (consecutive chunks): the RowNorm (helios.kernels.gemv)
    of a row no GEMV wrote (the embedding, before the first norm-free decode layer). As many partials as the
    gemv_add that writes the later rows (gemv.num_partials), so their readers are one compiled variant."""
    require_triton()
    assert x.dim() == 2 and x.shape[0] == 1, f"one row, got {tuple(x.shape)}"
    check_last_dim_contiguous("x", x)
    dim = x.shape[1]
    num_parts = max(1, min(num_parts, dim))
    out = torch.empty(num_parts, dtype=torch.float32, device=x.device)
    chunk = next_power_of_2(-(-dim // num_parts))
    parts = next_power_of_2(-(-dim // chunk))
    pdl = use_pdl(x, 1)
    _sum_squares_kernel[(1,)](x, out, dim, num_parts, PARTS=parts, CHUNK=chunk, USE_PDL=pdl,
                              num_warps=_row_warps(parts * chunk), launch_pdl=pdl)
    return out


def _row_warps(block: int) -> int:
    """Warps of a one-program-per-row kernel over `block` elements."""
    return 4 if block <= 1024 else WIDE_ROW_WARPS if block <= 4096 else 16


def _rows(x: torch.Tensor) -> tuple[int, int, int, int]:
    """(num_rows, inner_rows, stride0, stride1) of a [N, dim] or [N, M, dim] tensor."""
    if x.dim() == 2:
        return x.shape[0], 1, x.stride(0), 0
    assert x.dim() == 3, f"expected [N, dim] or [N, M, dim], got {tuple(x.shape)}"
    return x.shape[0] * x.shape[1], x.shape[1], x.stride(0), x.stride(1)


def _launch(x, residual, weight, eps, multiply_in_float32):
    require_triton()
    dim = x.shape[-1]
    assert weight.shape == (dim,), f"weight {tuple(weight.shape)} does not match dim {dim}"
    check_last_dim_contiguous("x", x)
    assert weight.is_contiguous()
    num_rows, inner, sx0, sx1 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype, "residual must match x"
        check_last_dim_contiguous("residual", residual)
        _, _, sr0, sr1 = _rows(residual)
        residual_out = torch.empty_like(out)
    else:
        sr0 = sr1 = 0
        residual_out = out  # never written
    if num_rows == 0:
        return out, residual_out
    block = next_power_of_2(dim)
    num_warps = _row_warps(block)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        residual_out,
        inner,
        sx0,
        sx1,
        sr0,
        sr1,
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        MULTIPLY_IN_FLOAT32=multiply_in_float32,
        BLOCK=block,
        USE_PDL=use_pdl(x, num_rows),
        num_warps=num_warps,
        launch_pdl=use_pdl(x, num_rows),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, dim] or [num_tokens, num_heads, dim]; rows may be strided
    weight: torch.Tensor,  # [dim]
    eps: float,
    multiply_in_float32: bool = False,
) -> torch.Tensor:  # same shape as x, contiguous, x.dtype
    return _launch(x, None, weight, eps, multiply_in_float32)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, dim]
    residual: torch.Tensor,  # [num_tokens, dim], same dtype as x
    weight: torch.Tensor,  # [dim]
    eps: float,
    multiply_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [num_tokens, dim], new residual x + residual)
    return _launch(x, residual, weight, eps, multiply_in_float32)


def rms_norm_ref(x, weight, eps, multiply_in_float32=False):
    """helios.layers.norm.rms_norm, restated so the kernels package depends on no layer."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if multiply_in_float32:
        return (h * weight.to(torch.float32)).to(input_dtype)
    return (weight * h.to(input_dtype)).to(input_dtype)


def fused_add_rms_norm_ref(x, residual, weight, eps, multiply_in_float32=False):
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps, multiply_in_float32), new_residual
