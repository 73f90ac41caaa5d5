"""deepseek_v4's interleaved rope (helios.layers.compressed_attention.rotate_tail) in one launch: each head's trailing
rope_dim values turned pair by pair ((2i, 2i + 1) at frequency i), optionally after the head's RMS norm (unweighted:
unit_rms, the queries'; weighted, multiplied in float32: kv_norm) or backwards (sin negated: the output turned back by
the query's angle). The pairs are read as two strided halves (evens, odds), so no rotate-half copy is made; the
rotation is done in float32 and rounded once, as rotate_tail does.

cos/sin rows [*, rope_dim / 2] come from a table indexed by positions (helios.layers.rotary.RotaryEmbedding.tabulate's
first half: no launch for them) or, without positions, one row per token. Imports torch and helios.kernels only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import cdiv, jit, next_power_of_2, require_triton, round_to, tl


@jit
def turn_pairs(even, odd, cos_ptr, sin_ptr, pairs, nope_pairs, pair_mask, INVERSE: tl.constexpr):
    """(even, odd) float32 halves [..., BLOCK_P] with pairs i >= nope_pairs turned by row cos/sin[i - nope_pairs]."""
    k = pairs - nope_pairs
    turned = pair_mask & (k >= 0)
    cos = tl.load(cos_ptr + k, mask=turned, other=1.0).to(tl.float32)
    sin = tl.load(sin_ptr + k, mask=turned, other=0.0).to(tl.float32)
    if INVERSE:
        sin = -sin
    new_even = tl.where(turned, even * cos - odd * sin, even)  # rotate_half of a pair: (-odd, even)
    new_odd = tl.where(turned, odd * cos + even * sin, odd)
    return new_even, new_odd


@jit
def _interleaved_rope_kernel(
    x_ptr,  # [num_tokens, num_heads, head_dim]
    out_ptr,  # [num_tokens, num_heads, head_dim], may be x
    cos_ptr,  # [rows, rope_dim / 2]
    sin_ptr,  # [rows, rope_dim / 2]
    positions_ptr,  # [num_tokens] int64, read only with HAS_POSITIONS
    weight_ptr,  # [head_dim] the norm's weight, read only with WEIGHTED
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    stride_cos,
    stride_sin,
    num_heads,
    head_dim,
    nope_pairs,  # (head_dim - rope_dim) / 2: the pairs that pass
    eps,
    HAS_POSITIONS: tl.constexpr,
    NORM: tl.constexpr,
    WEIGHTED: tl.constexpr,
    INVERSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    pairs = tl.arange(0, BLOCK_P)
    pair_mask = pairs < head_dim // 2
    mask = (heads < num_heads)[:, None] & pair_mask[None, :]
    src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + 2 * pairs[None, :]
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    DT: tl.constexpr = out_ptr.dtype.element_ty
    if NORM:
        factor = tl.rsqrt(tl.sum(even * even + odd * odd, axis=1) / head_dim + eps)[:, None]
        if WEIGHTED:  # rms_norm multiplied in float32: x * factor * w, rounded once
            w_even = tl.load(weight_ptr + 2 * pairs, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
            w_odd = tl.load(weight_ptr + 2 * pairs + 1, mask=pair_mask, other=0.0).to(tl.float32)[None, :]
            even = round_to(even * factor * w_even, DT)
            odd = round_to(odd * factor * w_odd, DT)
        else:  # unit_rms: the factor and the product rounded to x's dtype
            factor = round_to(factor, DT)
            even = round_to(even * factor, DT)
            odd = round_to(odd * factor, DT)
    row = tl.load(positions_ptr + t).to(tl.int64) if HAS_POSITIONS else t
    even, odd = turn_pairs(even, odd, cos_ptr + row * stride_cos, sin_ptr + row * stride_sin, pairs[None, :],
                           nope_pairs, pair_mask[None, :], INVERSE)
    dst = out_ptr + t * stride_ot + heads[:, None] * stride_oh + 2 * pairs[None, :]
    tl.store(dst, round_to(even, DT).to(DT), mask=mask)
    tl.store(dst + 1, round_to(odd, DT).to(DT), mask=mask)


def interleaved_rope(
    x: torch.Tensor,  # [num_tokens, num_heads, head_dim] (any head and token strides, unit last stride)
    cos: torch.Tensor,  # [rows, rope_dim / 2] in x's dtype: a table's (with positions) or one per token
    sin: torch.Tensor,  # same shape
    positions: torch.Tensor | None = None,  # [num_tokens] int64 rows of cos/sin; None: row t is token t
    *,
    norm_eps: float | None = None,  # the head's RMS norm first, with this eps: unweighted (unit_rms) or norm_weight's
    norm_weight: torch.Tensor | None = None,  # [head_dim]: rms_norm's weight, multiplied in float32
    inverse: bool = False,  # turn back (sin negated)
    out: torch.Tensor | None = None,  # [num_tokens, num_heads, head_dim] to write (may be x); None: a new tensor
    block_h: int | None = None,  # heads a program turns (tests: several blocks); None: from the widths
) -> torch.Tensor:  # out
    """rotate_tail(norm(x) if norm_eps else x, cos, -sin if inverse else sin) in one launch; norm: unit_rms, or
    rms_norm(x, norm_weight, norm_eps, multiply_in_float32=True)."""
    require_triton()
    num_tokens, num_heads, head_dim = x.shape
    half = cos.shape[1]
    assert cos.shape == sin.shape and cos.dim() == 2 and 2 * half <= head_dim and head_dim % 2 == 0
    assert cos.stride(1) == 1 and sin.stride(1) == 1 and x.stride(2) == 1, "cos/sin/x: unit last stride"
    if positions is None:
        assert cos.shape[0] == num_tokens, f"per-token cos/sin need {num_tokens} rows, got {cos.shape[0]}"
    else:
        assert positions.shape == (num_tokens,) and positions.dtype == torch.int64
    assert norm_weight is None or (norm_eps is not None and norm_weight.shape == (head_dim,))
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.stride(2) == 1
    if num_tokens == 0 or num_heads == 0:
        return out
    block_p = next_power_of_2(head_dim // 2)
    block_h = block_h or min(next_power_of_2(num_heads), max(1, 4096 // block_p))
    _interleaved_rope_kernel[(num_tokens, cdiv(num_heads, block_h))](
        x, out, cos, sin, positions if positions is not None else cos,
        norm_weight.contiguous() if norm_weight is not None else cos, x.stride(0), x.stride(1), out.stride(0),
        out.stride(1), cos.stride(0), sin.stride(0), num_heads, head_dim, head_dim // 2 - half,
        norm_eps if norm_eps is not None else 0.0, HAS_POSITIONS=positions is not None, NORM=norm_eps is not None,
        WEIGHTED=norm_weight is not None, INVERSE=inverse, BLOCK_H=block_h, BLOCK_P=block_p, num_warps=4,
    )
    return out


def interleaved_rope_ref(x, cos, sin, positions=None, *, norm_eps=None, norm_weight=None,
                         inverse=False) -> torch.Tensor:
    """helios.layers.compressed_attention's ops (unit_rms or kv_norm's rms_norm, then rotate_tail) on the gathered
    rows, in torch."""
    if positions is not None:
        cos, sin = cos[positions], sin[positions]
    if norm_weight is not None:
        h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + norm_eps)
        x = (h * norm_weight.float()).to(x.dtype)
    elif norm_eps is not None:
        x = x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + norm_eps).to(x.dtype)
    sin = -sin if inverse else sin
    cos, sin = cos.repeat_interleave(2, dim=-1)[:, None], sin.repeat_interleave(2, dim=-1)[:, None]
    r = cos.shape[-1]
    rope = x[..., -r:]
    pairs = rope.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([x[..., :-r], rotated], dim=-1)
