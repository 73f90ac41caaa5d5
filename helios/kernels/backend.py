"""TritonAttentionBackend: the helios.layers.attention.AttentionBackend of the GPU fast path.

Per layer and step: reshape_and_cache writes this step's K/V through slot_mapping, then a pure-decode batch
(one query per sequence, the CUDA-graph case) runs split-K decode attention, and any other batch (prefill,
chunked prefill, decode rows mixed in) runs the varlen prefill kernel. From the fused qkv output (forward_qkv)
a pure-decode batch takes one launch for norms, rotary, cache write and attention (decode_qkv). Host-side
decisions read only the metadata's *_cpu lists, never a device tensor. Imports torch and the kernels only: the
metadata is the layers' AttentionMetadata, read through the `PagedMetadata` protocol (kernels sit below layers).
"""

from __future__ import annotations

from typing import Protocol

import torch

from helios.kernels._triton import require_triton, sm_count
from helios.kernels.decode_qkv import decode_attention_qkv
from helios.kernels.gemv import RowNorm, times_rstd_ref
from helios.kernels.paged_attention import choose_num_splits, paged_decode_attention
from helios.kernels.prefill_attention import paged_prefill_attention
from helios.kernels.reshape_and_cache import reshape_and_cache
from helios.kernels.rotary_cache import rotary_and_cache


class PagedMetadata(Protocol):
    """The fields of helios.layers.attention.AttentionMetadata this backend reads."""

    slot_mapping: torch.Tensor  # [T] int64
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int: ...


class TritonAttentionBackend:
    """One instance serves every layer of a model.

    `decode_num_splits` pins the decode split count; a CUDA graph must pin it (the split count is a launch
    constant baked into the captured graph), eager decode picks it from the batch's longest sequence.
    `fused_decode` (the fused_decode switch, helios.switches): a decode-only batch attends from the qkv row in
    one launch (decode_qkv); False runs rotary_cache and paged decode attention instead (benchmarks compare).
    """

    name = "triton"
    # the layers of a model on this backend take the fused kernels too (residual + norm, rotary + cache
    # write, gated activation): helios.layers read this once at construction
    fuses_layers = True
    # forward() takes values narrower than head_dim (mimo_v2_flash's v heads): the cache write zero-pads them
    pads_values = True

    def __init__(self, decode_num_splits: int | None = None, fused_decode: bool = True):
        require_triton()
        assert decode_num_splits is None or decode_num_splits >= 1
        self.decode_num_splits = decode_num_splits
        self.fused_decode = fused_decode
        self._num_sms: dict[torch.device, int] = {}

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim or narrower: pads_values]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
        meta: PagedMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,  # [num_heads] sink logits
    ) -> torch.Tensor:  # [T, num_heads, v's width]
        reshape_and_cache(k, v, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale, sliding_window, softcap, sinks, out_dim=v.shape[-1])

    def forward_qkv(
        self,
        qkv: torch.Tensor,  # [T, (num_heads + 2 * num_kv_heads) * head_dim], the qkv projection's output
        cos: torch.Tensor,  # [T, head_dim]
        sin: torch.Tensor,  # [T, head_dim]
        num_heads: int,
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
        meta: PagedMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        qk_norm: tuple[torch.Tensor, torch.Tensor, float, bool] | None = None,  # (q weight, k weight, eps, f32)
        row_norm: RowNorm | None = None,  # one row: qkv projects the un-normed stream, times its rstd first
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """forward() with the q/k norms, rotary and the cache write in one launch (rotary_cache); a decode-only
        batch runs them inside its attention launch (decode_qkv), unless fused_decode is off (benchmarks).
        row_norm (helios.models.llama's norm-free layers): decode_qkv scales the row as it reads it; the other
        paths scale it first in torch."""
        q_norm, k_norm, eps, in_f32 = qk_norm if qk_norm is not None else (None, None, 1e-6, False)
        head_dim = kv_cache.shape[4]
        if qkv.shape[0] == meta.num_seqs and head_dim >= 32 and self.fused_decode:
            splits = self._decode_splits(meta, sliding_window, kv_cache.shape[3], qkv.device)
            return decode_attention_qkv(
                qkv, cos, sin, kv_cache, meta.slot_mapping, meta.block_tables, meta.seq_lens, num_heads, scale,
                sliding_window, softcap, q_norm, k_norm, eps, in_f32, num_splits=splits, row_norm=row_norm,
            )
        if row_norm is not None:
            qkv = times_rstd_ref(qkv, row_norm)
        q = rotary_and_cache(qkv, cos, sin, kv_cache, meta.slot_mapping, num_heads, q_norm, k_norm, eps, in_f32)
        return self._attend(q, kv_cache, meta, scale, sliding_window, softcap)

    def _attend(self, q, kv_cache, meta: PagedMetadata, scale, sliding_window, softcap, sinks=None,
                out_dim: int | None = None) -> torch.Tensor:  # [T, num_heads, out_dim or head_dim]
        """out_dim: the values' width when narrower than head_dim (their leading columns: a decode writes only
        those, a prompt's output is sliced)."""
        if q.shape[0] == meta.num_seqs:  # every sequence schedules >= 1 token, so each has exactly one
            return paged_decode_attention(
                q,
                kv_cache,
                meta.block_tables,
                meta.seq_lens,
                scale,
                sliding_window,
                softcap,
                num_splits=self._decode_splits(meta, sliding_window, kv_cache.shape[3], q.device),
                sinks=sinks,
                out_dim=out_dim,
            )
        qsl = meta.query_start_loc_cpu
        max_query_len = max(b - a for a, b in zip(qsl, qsl[1:]))
        return paged_prefill_attention(
            q,
            kv_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            max_query_len,
            scale,
            sliding_window,
            softcap,
            sinks=sinks,
        )[..., :out_dim]

    def _decode_splits(
        self, meta: PagedMetadata, sliding_window: int | None, num_kv_heads: int, device: torch.device
    ) -> int:
        if self.decode_num_splits is not None:
            return self.decode_num_splits
        longest = max(meta.seq_lens_cpu, default=0)
        if sliding_window is not None:
            longest = min(longest, sliding_window)
        return choose_num_splits(longest, meta.num_seqs, num_kv_heads, self._sm_count(device))

    def _sm_count(self, device: torch.device) -> int:
        if device not in self._num_sms:
            self._num_sms[device] = sm_count(device)  # the traced GPU's on meta tensors (helios.kernels.aot)
        return self._num_sms[device]
