"""Neox-style (rotate_half) rotary embedding applied in place to q and k, one program per token.

cos/sin are full-width rows [*, head_dim] as helios.layers.rotary builds them (the two halves are equal for
every frequency rule we serve, but both are read, so the kernel assumes nothing about them): either a table
indexed by positions, or (positions=None) the per-token rows RotaryEmbedding.cos_sin already gathered.
The rotation is done in float32 and rounded once. Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl


@jit
def _rotate_heads(
    x_ptr,  # one token's [num_heads, head_dim], heads strided by stride_h
    stride_h,
    num_heads,
    cos1,  # [1, BLOCK_HALF] float32, first half of the cos row
    cos2,
    sin1,
    sin2,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (cols < half)
    p1 = x_ptr + heads * stride_h + cols
    p2 = p1 + half
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    tl.store(p1, (x1 * cos1 - x2 * sin1).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, (x2 * cos2 + x1 * sin2).to(x_ptr.dtype.element_ty), mask=mask)


@jit
def _rotary_kernel(
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_ptr,  # [max_positions, head_dim]
    sin_ptr,  # [max_positions, head_dim]
    positions_ptr,  # [num_tokens] int64, read only with HAS_POSITIONS
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    stride_sin,
    num_heads,
    num_kv_heads,
    half,
    HAS_POSITIONS: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    if HAS_POSITIONS:
        pos = tl.load(positions_ptr + t).to(tl.int64)
    else:
        pos = t
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    cos1 = tl.load(cos_ptr + pos * stride_cos + cols, mask=cmask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + pos * stride_cos + half + cols, mask=cmask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + pos * stride_sin + cols, mask=cmask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + pos * stride_sin + half + cols, mask=cmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr + t * stride_qt, stride_qh, num_heads, cos1, cos2, sin1, sin2, half, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k_ptr + t * stride_kt, stride_kh, num_kv_heads, cos1, cos2, sin1, sin2, half, BLOCK_HK, BLOCK_HALF)


def rotary_embedding(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], rotated in place (may be a strided view)
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], rotated in place
    cos: torch.Tensor,  # [max_positions, head_dim], or [num_tokens, head_dim] without positions
    sin: torch.Tensor,  # same shape as cos
    positions: torch.Tensor | None = None,  # [num_tokens] int64 rows of cos/sin; None: row t is token t
) -> None:
    require_triton()
    num_tokens, num_heads, head_dim = q.shape
    assert k.dim() == 3 and k.shape[0] == num_tokens and k.shape[2] == head_dim, f"k {tuple(k.shape)} vs q"
    assert head_dim % 2 == 0, "rotary needs an even head_dim"
    assert cos.shape == sin.shape and cos.dim() == 2 and cos.shape[1] == head_dim, "cos/sin: [max_positions, D]"
    if positions is None:
        assert cos.shape[0] == num_tokens, f"per-token cos/sin need {num_tokens} rows, got {cos.shape[0]}"
    else:
        assert positions.shape == (num_tokens,), f"positions {tuple(positions.shape)}"
    assert q.dtype == k.dtype
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        q,
        k,
        cos,
        sin,
        positions if positions is not None else cos,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos.stride(0),
        sin.stride(0),
        num_heads,
        k.shape[1],
        half,
        HAS_POSITIONS=positions is not None,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(k.shape[1]),
        BLOCK_HALF=next_power_of_2(half),
        num_warps=4,
    )


def rotary_embedding_ref(q, k, cos, sin, positions=None) -> None:
    """helios.layers.rotary.apply_rotary on the gathered rows, in the input dtype, written back in place."""
    c = (cos if positions is None else cos[positions]).unsqueeze(1)  # [T, 1, D]
    s = (sin if positions is None else sin[positions]).unsqueeze(1)
    for x in (q, k):
        x1, x2 = x.chunk(2, dim=-1)
        x.copy_(x * c + torch.cat((-x2, x1), dim=-1) * s)
