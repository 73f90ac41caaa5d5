"""One launch per layer between the qkv projection and attention: optional per-head q/k RMSNorm, rotary on q
and k, q written out, k and v written into the paged cache through slot_mapping.

It replaces, on the GPU path, the q/k norms, the two rotary applications and reshape_and_cache (about a dozen
small launches per layer in eager torch). One program per token reads its fused qkv row once. Rotary is
rotate_half (neox) with full-width cos/sin rows per token (RotaryEmbedding.cos_sin), done in float32 and rounded
once, like helios.kernels.rotary; the norm follows helios.kernels.rmsnorm. A negative slot (a padded row of a
CUDA-graph batch) writes no cache. Imports torch and helios.kernels._triton only.
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


@jit
def _halves(rows, cols, half, mask):
    """The first and second halves of rotary rows: `rows` points at each row's start ([R, 1] or a scalar),
    `cols` [1, BLOCK_HALF]; masked lanes read 0. Two [R, BLOCK_HALF] tiles."""
    return tl.load(rows + cols, mask=mask, other=0.0), tl.load(rows + half + cols, mask=mask, other=0.0)


@jit
def _norm_rotate(
    x,  # [BLOCK_H, BLOCK_HALF] first halves, any float dtype
    y,  # [BLOCK_H, BLOCK_HALF] second halves
    w1,  # [1, BLOCK_HALF] float32 norm weight halves (unused without HAS_NORM)
    w2,
    cos1,  # [1, BLOCK_HALF] float32
    cos2,
    sin1,
    sin2,
    head_dim,
    eps,
    HAS_NORM: tl.constexpr,
    MULTIPLY_IN_FLOAT32: tl.constexpr,
):
    """(first, second) halves of norm-then-rotate in float32; [BLOCK_H, BLOCK_HALF] each."""
    x1 = x.to(tl.float32)
    x2 = y.to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / head_dim + eps)[:, None]
        if MULTIPLY_IN_FLOAT32:
            x1 = (x1 * inv * w1).to(x.dtype).to(tl.float32)
            x2 = (x2 * inv * w2).to(x.dtype).to(tl.float32)
        else:
            # HF: weight * h.to(dtype): round, multiply (exact in float32), round again
            x1 = ((x1 * inv).to(x.dtype).to(tl.float32) * w1).to(x.dtype).to(tl.float32)
            x2 = ((x2 * inv).to(x.dtype).to(tl.float32) * w2).to(x.dtype).to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@jit
def _rotary_cache_kernel(
    qkv_ptr,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]
    cos_ptr,  # [num_tokens, head_dim]
    sin_ptr,  # [num_tokens, head_dim]
    q_norm_ptr,  # [head_dim], read only with HAS_NORM
    k_norm_ptr,  # [head_dim], read only with HAS_NORM
    slot_mapping_ptr,  # [num_tokens] int64
    q_out_ptr,  # [num_tokens, num_heads, head_dim] contiguous
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    stride_qkv,
    stride_cos,
    stride_sin,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    num_heads,
    num_kv_heads,
    head_dim,
    eps,
    PAGE_SIZE: tl.constexpr,
    HAS_NORM: tl.constexpr,
    MULTIPLY_IN_FLOAT32: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    half = head_dim // 2
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    cmask = cols < half
    qw1 = tl.zeros([1, BLOCK_HALF], dtype=tl.float32)
    qw2 = qw1
    kw1 = qw1
    kw2 = qw1
    if HAS_NORM:  # weights: loaded before the wait (no kernel writes them)
        qw1, qw2 = _halves(q_norm_ptr, cols, half, cmask)
        kw1, kw2 = _halves(k_norm_ptr, cols, half, cmask)
        qw1, qw2, kw1, kw2 = qw1.to(tl.float32), qw2.to(tl.float32), kw1.to(tl.float32), kw2.to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    cos1, cos2 = _halves(cos_ptr + t * stride_cos, cols, half, cmask)
    sin1, sin2 = _halves(sin_ptr + t * stride_sin, cols, half, cmask)
    cos1, cos2, sin1, sin2 = cos1.to(tl.float32), cos2.to(tl.float32), sin1.to(tl.float32), sin2.to(tl.float32)
    row = qkv_ptr + t * stride_qkv

    # q: [num_heads, head_dim] at the row's start -> q_out
    hq = tl.arange(0, BLOCK_HQ)[:, None]
    qmask = (hq < num_heads) & cmask
    q1, q2 = _halves(row + hq * head_dim, cols, half, qmask)
    r1, r2 = _norm_rotate(q1, q2, qw1, qw2, cos1, cos2, sin1, sin2, head_dim, eps, HAS_NORM, MULTIPLY_IN_FLOAT32)
    out = q_out_ptr + t * num_heads * head_dim + hq * head_dim + cols
    tl.store(out, r1.to(q_out_ptr.dtype.element_ty), mask=qmask)
    tl.store(out + half, r2.to(q_out_ptr.dtype.element_ty), mask=qmask)

    # k (rotated) and v (as is) -> the cache slot of this token
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    hk = tl.arange(0, BLOCK_HK)[:, None]
    slot = tl.zeros([BLOCK_HK, BLOCK_HALF], dtype=tl.int64) + slot  # as a tile: a scalar mask term trips the interpreter
    kmask = (hk < num_kv_heads) & cmask & (slot >= 0)
    k_row = row + num_heads * head_dim + hk * head_dim
    k1, k2 = _halves(k_row, cols, half, kmask)
    r1, r2 = _norm_rotate(k1, k2, kw1, kw2, cos1, cos2, sin1, sin2, head_dim, eps, HAS_NORM, MULTIPLY_IN_FLOAT32)
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + hk * stride_ch + cols
    tl.store(k_cache_ptr + dst, r1.to(k_cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(k_cache_ptr + dst + half, r2.to(k_cache_ptr.dtype.element_ty), mask=kmask)
    v_row = k_row + num_kv_heads * head_dim
    v1, v2 = _halves(v_row, cols, half, kmask)
    tl.store(v_cache_ptr + dst, v1.to(v_cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(v_cache_ptr + dst + half, v2.to(v_cache_ptr.dtype.element_ty), mask=kmask)


def rotary_and_cache(
    qkv: torch.Tensor,  # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], rows contiguous
    cos: torch.Tensor,  # [num_tokens, head_dim] per-token rows
    sin: torch.Tensor,  # [num_tokens, head_dim]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = no cache write
    num_heads: int,
    q_norm: torch.Tensor | None = None,  # [head_dim] per-head RMSNorm weight of q (qwen3), with k_norm
    k_norm: torch.Tensor | None = None,  # [head_dim]
    eps: float = 1e-6,
    multiply_in_float32: bool = False,
) -> torch.Tensor:  # q: [num_tokens, num_heads, head_dim], normed and rotated
    require_triton()
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_pages, page_size, Nkv, D]"
    _, _, page_size, num_kv_heads, head_dim = kv_cache.shape
    num_tokens = qkv.shape[0]
    assert qkv.dim() == 2 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim, f"qkv {tuple(qkv.shape)}"
    assert head_dim % 2 == 0, "rotary needs an even head_dim"
    assert cos.shape == sin.shape == (num_tokens, head_dim), f"cos/sin {tuple(cos.shape)}: one row per token"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    assert (q_norm is None) == (k_norm is None), "q and k norms come together"
    for name, t in (("qkv", qkv), ("cos", cos), ("sin", sin), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    has_norm = q_norm is not None
    _rotary_cache_kernel[(num_tokens,)](
        qkv,
        cos,
        sin,
        q_norm if has_norm else cos,
        k_norm if has_norm else cos,
        slot_mapping,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_heads,
        num_kv_heads,
        head_dim,
        eps,
        PAGE_SIZE=page_size,
        HAS_NORM=has_norm,
        MULTIPLY_IN_FLOAT32=multiply_in_float32,
        BLOCK_HQ=next_power_of_2(num_heads),
        BLOCK_HK=next_power_of_2(num_kv_heads),
        BLOCK_HALF=next_power_of_2(head_dim // 2),
        USE_PDL=use_pdl(qkv, num_tokens),
        num_warps=4 if num_heads * head_dim <= 2048 else 8,
        launch_pdl=use_pdl(qkv, num_tokens),
    )
    return q


def rotary_and_cache_ref(
    qkv, cos, sin, kv_cache, slot_mapping, num_heads, q_norm=None, k_norm=None, eps=1e-6, multiply_in_float32=False
) -> torch.Tensor:
    """The unfused path: norms (helios.kernels.rmsnorm's reference), rotary in float32 rounded once, cache write."""
    from helios.kernels.reshape_and_cache import reshape_and_cache_ref
    from helios.kernels.rmsnorm import rms_norm_ref

    num_kv_heads, head_dim = kv_cache.shape[3], kv_cache.shape[4]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(-1, num_heads, head_dim)
    k = k.reshape(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    if q_norm is not None:
        q = rms_norm_ref(q, q_norm, eps, multiply_in_float32)
        k = rms_norm_ref(k, k_norm, eps, multiply_in_float32)
    c, s = cos.float().unsqueeze(1), sin.float().unsqueeze(1)

    def rotate(x):
        x = x.float()
        x1, x2 = x.chunk(2, dim=-1)
        return (x * c + torch.cat((-x2, x1), dim=-1) * s).to(qkv.dtype)

    q, k = rotate(q), rotate(k)
    reshape_and_cache_ref(k, v, kv_cache, slot_mapping)
    return q
