"""Write this step's K/V into the paged cache through slot_mapping (slot = block_id * page_size + offset).

One program per token copies its [num_kv_heads, head_dim] key and value rows into the cache, converting to
the cache dtype. A negative slot (a padded row of a CUDA-graph batch) writes nothing. A value row narrower than
head_dim (mimo_v2_flash's v heads) is written zero-padded to head_dim, as the pages keep it (no padded copy first).
Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

import torch

from helios.kernels._triton import check_last_dim_contiguous, jit, next_power_of_2, require_triton, tl


@jit
def _reshape_and_cache_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim]
    v_ptr,  # [num_tokens, num_kv_heads, v_dim]
    k_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_pages, page_size, num_kv_heads, head_dim], same strides as k
    slot_mapping_ptr,  # [num_tokens] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cp,  # cache strides: page, slot in page, kv head
    stride_cs,
    stride_ch,
    num_kv_heads,
    head_dim,
    v_dim,  # v's columns (<= head_dim); the cache's value columns past them get zeros
    PAGE_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    slot = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.int64) + slot  # as a tile: a scalar mask term trips the interpreter
    mask = (heads < num_kv_heads) & (d < head_dim) & (slot >= 0)
    dst = (slot // PAGE_SIZE) * stride_cp + (slot % PAGE_SIZE) * stride_cs + heads * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + heads * stride_kh + d, mask=mask, other=0.0)
    v = tl.load(v_ptr + t * stride_vt + heads * stride_vh + d, mask=mask & (d < v_dim), other=0.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim] (may be a strided view of the qkv output)
    v: torch.Tensor,  # [num_tokens, num_kv_heads, v_dim <= head_dim] (zero-padded to head_dim in the cache)
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim], written in place
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    require_triton()
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape[:2] == k.shape[:2] and v.shape[2] <= head_dim, f"v {tuple(v.shape)} vs k {tuple(k.shape)}"
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, "kv_cache must be [2, num_pages, page_size, Nkv, D]"
    assert tuple(kv_cache.shape[3:]) == (num_kv_heads, head_dim), f"cache {tuple(kv_cache.shape)} vs k"
    assert slot_mapping.shape == (num_tokens,) and slot_mapping.dtype == torch.int64
    for name, t in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_last_dim_contiguous(name, t)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _reshape_and_cache_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        num_kv_heads,
        head_dim,
        v.shape[2],
        PAGE_SIZE=kv_cache.shape[2],
        BLOCK_H=next_power_of_2(num_kv_heads),
        BLOCK_D=next_power_of_2(head_dim),
        num_warps=4,
    )


def reshape_and_cache_ref(k, v, kv_cache, slot_mapping) -> None:
    """helios.layers.attention.write_kv, skipping negative slots (a narrow v zero-padded to the cache's width)."""
    v = torch.nn.functional.pad(v, (0, kv_cache.shape[-1] - v.shape[-1]))
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, num_slots, Nkv, D]
    flat[0].index_copy_(0, slots, k[keep].to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v[keep].to(kv_cache.dtype))
