"""RMSNorm and RMSNorm fused with the residual add, one program per row, float32 statistics.

Numerics follow helios.layers.norm (HF): y = x * rsqrt(mean(x^2) + eps) * w with the statistics in float32;
llama/qwen round the normalized value to the input dtype before the weight multiply, gemma multiplies in
float32 (`multiply_in_float32`); a weightless norm (weight None) rounds x / rms(x) to x's dtype; `scale_first`
(muse_spark) normalizes x * w rounded to x's dtype. The fused variant first forms residual = x + residual in x.dtype
(the one rounding torch's add does) and normalizes that. Norms fused with more (a sandwich layer's tail, the q/k
norms with their rotary) are helios.kernels.norm_fused. Imports torch and helios.kernels._triton only.
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

# how a norm's weight applies (the WEIGHT constexpr)
UNIT, WEIGHT_AFTER, SCALE_FIRST = 0, 1, 2


@jit
def _normalize(
    x,  # [BLOCK] a row (masked lanes 0), any float dtype
    w,  # [BLOCK] float32 weight (unread with UNIT)
    dim,
    eps,
    WEIGHT: tl.constexpr,  # UNIT, WEIGHT_AFTER or SCALE_FIRST
    MULTIPLY_IN_FLOAT32: tl.constexpr,
):
    """The normed row in float32, to be rounded once to the output dtype."""
    if WEIGHT == 2:  # SCALE_FIRST: norm(x * w), the product rounded to x's dtype as torch's .to(x.dtype)
        x = (x.to(tl.float32) * w).to(x.dtype)
    h = x.to(tl.float32)
    mean_square = tl.sum(h * h, axis=0) / dim
    h = h * tl.rsqrt(mean_square + eps)
    if WEIGHT == 1:
        if MULTIPLY_IN_FLOAT32:
            h = h * w
        else:
            # HF: weight * h.to(input_dtype); the float32 product of two 16-bit floats is exact, so one
            # rounding after reproduces torch's 16-bit multiply bit for bit.
            h = h.to(x.dtype).to(tl.float32) * w
    return h


@jit
def _rms_norm_kernel(
    x_ptr,  # [num_rows, dim] (rows addressed as (i, j) of a 2- or 3-d tensor)
    residual_ptr,  # [num_rows, dim], read only with HAS_RESIDUAL
    weight_ptr,  # [dim], unread with WEIGHT == UNIT
    gate_ptr,  # [num_rows, dim] rows addressed as x's, read only with HAS_GATE
    out_ptr,  # [num_rows, dim] contiguous
    residual_out_ptr,  # [num_rows, dim] contiguous, written only with HAS_RESIDUAL
    inner_rows,  # size of the second leading dimension (1 for a 2-d input)
    stride_x0,
    stride_x1,
    stride_r0,
    stride_r1,
    stride_g0,
    stride_g1,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
    WEIGHT: tl.constexpr,  # UNIT, WEIGHT_AFTER or SCALE_FIRST
    HAS_GATE: tl.constexpr,  # the normed row (rounded) times sigmoid(gate) (rounded), rounded
):
    row = tl.program_id(0).to(tl.int64)
    i = row // inner_rows
    j = row % inner_rows
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    w = 0.0
    if WEIGHT != 0:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: no kernel writes it
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + i * stride_x0 + j * stride_x1 + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + i * stride_r0 + j * stride_r1 + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * dim + cols, x, mask=mask)
    y = _normalize(x, w, dim, eps, WEIGHT, MULTIPLY_IN_FLOAT32)
    if HAS_GATE:  # torch: norm(x) * torch.sigmoid(gate), each op rounded to x's dtype
        g = tl.load(gate_ptr + i * stride_g0 + j * stride_g1 + cols, mask=mask, other=0.0)
        g = tl.sigmoid(g.to(tl.float32)).to(x.dtype).to(tl.float32)
        y = y.to(x.dtype).to(tl.float32) * g
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


def _weight_mode(weight: torch.Tensor | None, scale_first: bool) -> int:
    if weight is None:
        assert not scale_first, "scale_first needs a weight"
        return UNIT
    return SCALE_FIRST if scale_first else WEIGHT_AFTER


def _check_weight(weight: torch.Tensor | None, dim: int) -> None:
    if weight is not None:
        assert weight.shape == (dim,), f"weight {tuple(weight.shape)} does not match dim {dim}"
        assert weight.is_contiguous()


def _launch(x, residual, weight, eps, multiply_in_float32, scale_first=False, gate=None):
    require_triton()
    dim = x.shape[-1]
    _check_weight(weight, dim)
    check_last_dim_contiguous("x", x)
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
    if gate is not None:
        assert gate.shape == x.shape and gate.dtype == x.dtype, "gate must match x"
        check_last_dim_contiguous("gate", gate)
        _, _, sg0, sg1 = _rows(gate)
    else:
        sg0 = sg1 = 0
    if num_rows == 0:
        return out, residual_out
    block = next_power_of_2(dim)
    num_warps = _row_warps(block)
    _rms_norm_kernel[(num_rows,)](
        x,
        residual if residual is not None else x,
        weight if weight is not None else x,
        gate if gate is not None else x,
        out,
        residual_out,
        inner,
        sx0,
        sx1,
        sr0,
        sr1,
        sg0,
        sg1,
        dim,
        eps,
        HAS_RESIDUAL=residual is not None,
        MULTIPLY_IN_FLOAT32=multiply_in_float32,
        BLOCK=block,
        USE_PDL=use_pdl(x, num_rows),
        WEIGHT=_weight_mode(weight, scale_first),
        HAS_GATE=gate is not None,
        num_warps=num_warps,
        launch_pdl=use_pdl(x, num_rows),
    )
    return out, residual_out


def rms_norm(
    x: torch.Tensor,  # [num_tokens, dim] or [num_tokens, num_heads, dim]; rows may be strided
    weight: torch.Tensor | None,  # [dim]; None: a weightless norm, x / rms(x)
    eps: float,
    multiply_in_float32: bool = False,
    *,
    scale_first: bool = False,  # norm(x * weight), the product rounded to x's dtype (muse_spark)
    sigmoid_gate: torch.Tensor | None = None,  # same shape as x (rows may be strided): the result * sigmoid(gate)
) -> torch.Tensor:  # same shape as x, contiguous, x.dtype
    return _launch(x, None, weight, eps, multiply_in_float32, scale_first, sigmoid_gate)[0]


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, dim]
    residual: torch.Tensor,  # [num_tokens, dim], same dtype as x
    weight: torch.Tensor,  # [dim]
    eps: float,
    multiply_in_float32: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (normed [num_tokens, dim], new residual x + residual)
    return _launch(x, residual, weight, eps, multiply_in_float32)


def rms_norm_ref(x, weight, eps, multiply_in_float32=False, *, scale_first=False, sigmoid_gate=None):
    """helios.layers.norm's torch norms (rms_norm, rms_normalize, RMSNorm's scale_first), restated so the kernels
    package depends on no layer; with sigmoid_gate, times torch.sigmoid(gate) as muse_spark's attention does."""
    input_dtype = x.dtype
    if scale_first:
        x = (x.float() * weight.float()).to(input_dtype)
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if weight is None or scale_first:
        y = h.to(input_dtype)
    elif multiply_in_float32:
        y = (h * weight.to(torch.float32)).to(input_dtype)
    else:
        y = (weight * h.to(input_dtype)).to(input_dtype)
    return y if sigmoid_gate is None else y * torch.sigmoid(sigmoid_gate)


def fused_add_rms_norm_ref(x, residual, weight, eps, multiply_in_float32=False):
    new_residual = x + residual
    return rms_norm_ref(new_residual, weight, eps, multiply_in_float32), new_residual
