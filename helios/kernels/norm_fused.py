"""RMSNorms fused with their neighbours, one program per row: `norm_add_norm` is a sandwich layer's tail in one launch
(a post-norm of the sublayer's output, the residual add or a float32 gate alpha * r + beta * h, a scalar, the next
pre-norm); `rms_norm_rope` the q and k heads' norms and their rotary (partial too, rounded once or as apply_rotary
rounds). Each norm computes as helios.kernels.rmsnorm's (its `_normalize`, float32 statistics, the weight modes).
Imports torch, helios.kernels._triton and .rmsnorm only.
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
    round_to,
    tl,
    use_pdl,
)
from helios.kernels.rmsnorm import _check_weight, _normalize, _row_warps, _weight_mode


@jit
def _norm_add_norm_kernel(
    h_ptr,  # [num_rows, dim] a sublayer's output, row stride stride_h
    residual_ptr,  # [num_rows, dim] the stream, row stride stride_r; read only with HAS_RESIDUAL
    post_w_ptr,  # [dim] the post-norm's weight, unread with POST_WEIGHT == UNIT
    gate_ptr,  # [2, dim] contiguous: alpha, beta; read only with HAS_GATE
    scale_ptr,  # [1] the stream's scalar, read only with HAS_SCALE
    pre_w_ptr,  # [dim] the next pre-norm's weight, read only with HAS_PRE
    stream_out_ptr,  # [num_rows, dim] contiguous
    normed_out_ptr,  # [num_rows, dim] contiguous, written only with HAS_PRE
    stride_h,
    stride_r,
    dim,
    post_eps,
    pre_eps,
    POST_WEIGHT: tl.constexpr,  # UNIT, WEIGHT_AFTER or SCALE_FIRST
    POST_MULTIPLY_IN_FLOAT32: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    HAS_PRE: tl.constexpr,
    PRE_MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    # weights first (no kernel writes them), then wait for the kernels that wrote h and the stream
    w_post = 0.0
    if POST_WEIGHT != 0:
        w_post = tl.load(post_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    w_pre = 0.0
    if HAS_PRE:
        w_pre = tl.load(pre_w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:
        alpha = tl.load(gate_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        beta = tl.load(gate_ptr + dim + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    h = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
    dtype = h.dtype
    s = _normalize(h, w_post, dim, post_eps, POST_WEIGHT, POST_MULTIPLY_IN_FLOAT32).to(dtype)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_GATE:  # muse_spark's residual gate: alpha * r + beta * h in float32, rounded once
            s = (alpha * r + beta * s.to(tl.float32)).to(dtype)
        else:
            s = (r + s.to(tl.float32)).to(dtype)
    if HAS_SCALE:
        s = (s.to(tl.float32) * scale).to(dtype)
    tl.store(stream_out_ptr + row * dim + cols, s, mask=mask)
    if HAS_PRE:
        y = _normalize(s, w_pre, dim, pre_eps, 1, PRE_MULTIPLY_IN_FLOAT32)
        tl.store(normed_out_ptr + row * dim + cols, y.to(dtype), mask=mask)


@jit
def _rms_norm_rope_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim] rows addressed as (t, j)
    weight_ptr,  # [head_dim] the first num_first heads' weight, unread with WEIGHT == UNIT
    weight2_ptr,  # [head_dim] the other heads' weight, unread with WEIGHT == UNIT
    cos_ptr,  # [num_tokens, rotary_dim] rows of stride_cos, read only with ROTARY
    sin_ptr,  # [num_tokens, rotary_dim] rows of stride_sin
    out_ptr,  # [num_tokens, num_heads, head_dim] contiguous
    num_heads,
    num_first,  # heads (from 0) normed with weight_ptr
    stride_x0,
    stride_x1,
    stride_cos,
    stride_sin,
    half,  # rotary_dim // 2 (head_dim // 2 without rotary)
    head_dim,
    eps,
    WEIGHT: tl.constexpr,  # UNIT or WEIGHT_AFTER
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    ROTARY: tl.constexpr,
    ROUND_PRODUCTS: tl.constexpr,  # apply_rotary's roundings (each product, then the sum) instead of one
    HAS_PASS: tl.constexpr,  # partial rotary: dims 2 * half .. head_dim - 1 pass unturned
    BLOCK_HALF: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Program (token, head): the head's norm over its head_dim values, read as the rotated halves [0, half),
    [half, 2 * half) and (partial rotary) the passed rest."""
    row = tl.program_id(0).to(tl.int64)
    t = row // num_heads
    j = row % num_heads
    cols = tl.arange(0, BLOCK_HALF)
    mask = cols < half
    rest = 2 * half + tl.arange(0, BLOCK_PASS)
    rest_mask = rest < head_dim
    w1 = 0.0
    w2 = 0.0
    w3 = 0.0
    if WEIGHT != 0:  # weights: no kernel writes them; the row's head picks one of the two
        first = j < num_first
        w1 = tl.where(first, tl.load(weight_ptr + cols, mask=mask, other=0.0),
                      tl.load(weight2_ptr + cols, mask=mask, other=0.0)).to(tl.float32)
        w2 = tl.where(first, tl.load(weight_ptr + half + cols, mask=mask, other=0.0),
                      tl.load(weight2_ptr + half + cols, mask=mask, other=0.0)).to(tl.float32)
        if HAS_PASS:
            w3 = tl.where(first, tl.load(weight_ptr + rest, mask=rest_mask, other=0.0),
                          tl.load(weight2_ptr + rest, mask=rest_mask, other=0.0)).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x_row = x_ptr + t * stride_x0 + j * stride_x1
    x1 = tl.load(x_row + cols, mask=mask, other=0.0)
    x2 = tl.load(x_row + half + cols, mask=mask, other=0.0)
    dtype = x1.dtype
    h1 = x1.to(tl.float32)
    h2 = x2.to(tl.float32)
    square_sum = tl.sum(h1 * h1, axis=0) + tl.sum(h2 * h2, axis=0)
    h3 = tl.zeros([BLOCK_PASS], dtype=tl.float32)
    if HAS_PASS:
        h3 = tl.load(x_row + rest, mask=rest_mask, other=0.0).to(tl.float32)
        square_sum += tl.sum(h3 * h3, axis=0)
    inv = tl.rsqrt(square_sum / head_dim + eps)
    h1 = h1 * inv
    h2 = h2 * inv
    h3 = h3 * inv
    if WEIGHT != 0:
        if MULTIPLY_IN_FLOAT32:
            h1 = h1 * w1
            h2 = h2 * w2
            h3 = h3 * w3
        else:  # weight * h.to(dtype), as _normalize
            h1 = round_to(h1, dtype) * w1
            h2 = round_to(h2, dtype) * w2
            h3 = round_to(h3, dtype) * w3
    # the norm's output rounded to x's dtype, then rotated: in float32 and rounded once (helios.kernels.rotary), or
    # with ROUND_PRODUCTS as apply_rotary's torch ops round (x * cos and rotate_half(x) * sin, then their sum)
    h1 = round_to(h1, dtype)
    h2 = round_to(h2, dtype)
    if ROTARY:
        cos1 = tl.load(cos_ptr + t * stride_cos + cols, mask=mask, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + t * stride_cos + half + cols, mask=mask, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + t * stride_sin + cols, mask=mask, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + t * stride_sin + half + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_PRODUCTS:  # -x2 * sin rounds as -(x2 * sin): rounding to nearest even is symmetric
            r1 = round_to(h1 * cos1, dtype) - round_to(h2 * sin1, dtype)
            r2 = round_to(h2 * cos2, dtype) + round_to(h1 * sin2, dtype)
        else:
            r1 = h1 * cos1 - h2 * sin1
            r2 = h2 * cos2 + h1 * sin2
        h1 = r1
        h2 = r2
    out_row = out_ptr + row * head_dim
    tl.store(out_row + cols, round_to(h1, dtype).to(dtype), mask=mask)
    tl.store(out_row + half + cols, round_to(h2, dtype).to(dtype), mask=mask)
    if HAS_PASS:
        tl.store(out_row + rest, round_to(h3, dtype).to(dtype), mask=rest_mask)


def norm_add_norm(
    h: torch.Tensor,  # [num_tokens, dim] a sublayer's output; rows may be strided
    residual: torch.Tensor | None,  # [num_tokens, dim], h's dtype; None: the stream is post(h)
    post_weight: torch.Tensor | None,  # [dim]; None: a weightless post-norm
    post_eps: float,
    pre_weight: torch.Tensor | None,  # [dim]; None: no pre-norm (normed is None)
    pre_eps: float = 0.0,
    *,
    post_multiply_in_float32: bool = False,
    post_scale_first: bool = False,
    pre_multiply_in_float32: bool = False,
    gate: torch.Tensor | None = None,  # [2, dim] (alpha, beta): stream = alpha * residual + beta * post(h), float32
    scale: torch.Tensor | None = None,  # [1], h's dtype: the stream times scale
) -> tuple[torch.Tensor | None, torch.Tensor]:  # (pre(stream) or None, stream), each [num_tokens, dim] contiguous
    """stream = residual + post(h) (or the gate's sum), times scale; then pre(stream): one launch for a sandwich
    layer's post-norm, residual add and the next layer's norm. Each step rounded to h's dtype as torch's ops are."""
    require_triton()
    assert h.dim() == 2, f"expected [num_tokens, dim], got {tuple(h.shape)}"
    num_rows, dim = h.shape
    check_last_dim_contiguous("h", h)
    _check_weight(post_weight, dim)
    _check_weight(pre_weight, dim)
    if residual is not None:
        assert residual.shape == h.shape and residual.dtype == h.dtype, "residual must match h"
        check_last_dim_contiguous("residual", residual)
    else:
        assert gate is None, "a gate needs a residual"
    if gate is not None:
        assert gate.shape == (2, dim) and gate.is_contiguous(), f"gate {tuple(gate.shape)}: [2, {dim}] contiguous"
    if scale is not None:
        assert scale.numel() == 1 and scale.dtype == h.dtype, "scale: one value of h's dtype"
    stream = torch.empty(h.shape, dtype=h.dtype, device=h.device)
    normed = torch.empty_like(stream) if pre_weight is not None else None
    if num_rows == 0:
        return normed, stream
    block = next_power_of_2(dim)
    pdl = use_pdl(h, num_rows)
    _norm_add_norm_kernel[(num_rows,)](
        h,
        residual if residual is not None else h,
        post_weight if post_weight is not None else h,
        gate if gate is not None else h,
        scale if scale is not None else h,
        pre_weight if pre_weight is not None else h,
        stream,
        normed if normed is not None else stream,
        h.stride(0),
        residual.stride(0) if residual is not None else 0,
        dim,
        post_eps,
        pre_eps,
        POST_WEIGHT=_weight_mode(post_weight, post_scale_first),
        POST_MULTIPLY_IN_FLOAT32=post_multiply_in_float32,
        HAS_RESIDUAL=residual is not None,
        HAS_GATE=gate is not None,
        HAS_SCALE=scale is not None,
        HAS_PRE=pre_weight is not None,
        PRE_MULTIPLY_IN_FLOAT32=pre_multiply_in_float32,
        BLOCK=block,
        USE_PDL=pdl,
        num_warps=_row_warps(block),
        launch_pdl=pdl,
    )
    return normed, stream


def rms_norm_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim]; rows may be strided (heads of a projection's output)
    weight: torch.Tensor | None,  # [head_dim] the first `num_first` heads' weight; None: weightless norms
    eps: float,
    multiply_in_float32: bool = False,
    *,
    weight2: torch.Tensor | None = None,  # [head_dim] the other heads' weight (k_norm's beside q_norm's)
    num_first: int | None = None,  # heads normed with `weight` (default all)
    cos: torch.Tensor | None = None,  # [num_tokens, rotary_dim] rotary rows (rows may be strided); None: no rotary
    sin: torch.Tensor | None = None,
    round_products: bool = False,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim] contiguous, x.dtype
    """Per-head RMSNorms (q's and k's, adjacent in a projection's output) and the rotary of every head, in one launch:
    rms_norm's values rounded to x's dtype, then helios.kernels.rotary's rotation (float32, rounded once), or with
    round_products apply_rotary's (each product rounded to x's dtype, then their sum). A rotary_dim below head_dim
    is partial rotary: the leading rotary_dim dims of each head turn, the rest pass normed."""
    require_triton()
    assert x.dim() == 3, f"expected [num_tokens, num_heads, head_dim], got {tuple(x.shape)}"
    num_tokens, num_heads, head_dim = x.shape
    check_last_dim_contiguous("x", x)
    num_first = num_heads if num_first is None else num_first
    _check_weight(weight, head_dim)
    if num_first < num_heads and weight is not None:
        _check_weight(weight2, head_dim)
        assert weight2 is not None and weight2.dtype == weight.dtype
    assert (cos is None) == (sin is None), "cos and sin together"
    rotary_dim = head_dim if cos is None else cos.shape[-1]
    assert rotary_dim % 2 == 0 and rotary_dim <= head_dim, f"rotary halves need an even rotary_dim <= {head_dim}"
    if cos is not None:
        assert cos.shape == sin.shape == (num_tokens, rotary_dim), f"cos/sin {tuple(cos.shape)}: [T, {rotary_dim}]"
        check_last_dim_contiguous("cos", cos)
        check_last_dim_contiguous("sin", sin)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    num_rows = num_tokens * num_heads
    if num_rows == 0:
        return out
    half = rotary_dim // 2
    pdl = use_pdl(x, num_rows)
    _rms_norm_rope_kernel[(num_rows,)](
        x,
        weight if weight is not None else x,
        weight2 if weight2 is not None else (weight if weight is not None else x),
        cos if cos is not None else x,
        sin if sin is not None else x,
        out,
        num_heads,
        num_first,
        x.stride(0),
        x.stride(1),
        cos.stride(0) if cos is not None else 0,
        sin.stride(0) if sin is not None else 0,
        half,
        head_dim,
        eps,
        WEIGHT=_weight_mode(weight, False),
        MULTIPLY_IN_FLOAT32=multiply_in_float32,
        ROTARY=cos is not None,
        ROUND_PRODUCTS=round_products,
        HAS_PASS=rotary_dim < head_dim,
        BLOCK_HALF=next_power_of_2(half),
        BLOCK_PASS=next_power_of_2(max(1, head_dim - rotary_dim)),
        USE_PDL=pdl,
        num_warps=_row_warps(next_power_of_2(head_dim)),
        launch_pdl=pdl,
    )
    return out
