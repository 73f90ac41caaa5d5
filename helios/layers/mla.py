"""Multi-head latent attention (MLA: deepseek_v3's attention, kimi_linear's full layers) over paged latent caches.

Per token and layer the cache keeps the kv latent after its RMSNorm (R = kv_lora_rank values) and the rope key every
head shares (dr values): one [1, num_pages, page_size, R + dr] tensor per layer (helios.runner.kv_cache), never
per-head K/V. The same attention has two forms here:
- expanded (a sequence with several query tokens: prefill): kv_b up-projects the sequence's cached latents to
  per-head k_nope [S, Nq, dn] and v [S, Nq, dv]; k = [k_nope, rope key]; causal SDPA, as HF computes it;
- absorbed (a sequence with one query token: decode): kv_b's k rows fold into q (q_lat = q_nope W_uk, R wide) and its
  v rows apply after attention, which reads the latent pages as they are: one-head MQA of width R + dr.
Which form a sequence takes depends on its own query count only, never on the batch around it. On the Triton backend
(the layer built with it) the absorbed form's attention is helios.kernels.mla_decode's kernel over the pages, from
device-side lengths and tables (CUDA graphs), and the cache write skips padded rows; the expanded form stays torch.
Imports torch and helios.core only (and helios.layers' linear, norm and rotary; the kernels lazily).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import MlaConfig
from helios.layers.attention import AttentionBackend, AttentionMetadata, decode_rows, single_rows
from helios.layers.linear import Linear, linear
from helios.layers.norm import RMSNorm
from helios.layers.rotary import apply_rotary
from helios.layers.transfer import device_tensor, to_device
from helios.switches import DEFAULT_SWITCHES, Switches


def write_latent(
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    latent: torch.Tensor,  # [T, R], after its norm
    rope_key: torch.Tensor,  # [T, dr], rotated where the model uses rope
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    flat = cache.view(-1, cache.shape[-1])  # [num_slots, R + dr]
    flat.index_copy_(0, slot_mapping, torch.cat([latent, rope_key], dim=-1).to(cache.dtype))


def mla_expanded(
    q: torch.Tensor,  # [L, Nq, dn + dr], the sequence's last L query tokens
    cached: torch.Tensor,  # [S, R + dr], the sequence's latents and rope keys, positions 0 .. S-1
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R], per head dn k_nope rows then dv v rows
    config: MlaConfig,
    mask: torch.Tensor | None = None,  # [L, S] bool: the keys each query attends to (DSA's selection); None: causal
) -> torch.Tensor:  # [L, Nq, dv]
    """Up-project every cached latent to per-head keys and values, then causal attention (query i sits at position
    S - L + i), or attention under `mask`."""
    c = config
    num_queries, num_heads, _ = q.shape
    num_keys = cached.shape[0]
    kv = linear(cached[:, : c.kv_lora_rank], kv_b).view(num_keys, num_heads, c.qk_nope_head_dim + c.v_head_dim)
    k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
    rope = cached[:, None, c.kv_lora_rank :].to(q.dtype).expand(num_keys, num_heads, c.qk_rope_head_dim)
    k = torch.cat([k_nope, rope], dim=-1)  # [S, Nq, dn + dr]
    if mask is None and num_queries > 1:
        q_pos = torch.arange(num_keys - num_queries, num_keys, device=q.device)[:, None]
        mask = torch.arange(num_keys, device=q.device)[None, :] <= q_pos  # [L, S]
    # NOTE: 4-d operands: CPU SDPA's flash kernel (3-d ones take the math path, helios.layers.attention says more)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                       attn_mask=mask, scale=c.softmax_scale)[0]
    return o.transpose(0, 1)


def mla_absorbed(
    q: torch.Tensor,  # [B, Nq, dn + dr], one query token per sequence
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    blocks: torch.Tensor,  # [B, nb] int64, each sequence's pages
    bias: torch.Tensor,  # [B, 1, nb * page_size] float32: 0 where the query attends, -inf past the sequence's end
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    config: MlaConfig,
) -> torch.Tensor:  # [B, Nq, dv]
    """Attention straight over the latent pages: scores = [q_nope W_uk, q_rope] . [latent, rope key], the output
    latent p . latent goes through W_uv. Masked keys get probability exactly 0, so padding changes no result."""
    c = config
    q_abs = absorb_query(q, kv_b, c)  # [B, Nq, R + dr]
    latents = cache[0, blocks].flatten(1, 2).to(q.dtype)  # [B, S, R + dr]
    scores = torch.add(bias, torch.matmul(q_abs, latents.transpose(1, 2)), alpha=c.softmax_scale)  # [B, Nq, S]
    p = torch.softmax(scores, dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32)).to(q.dtype)
    return expand_output(torch.matmul(p, latents[..., : c.kv_lora_rank]), kv_b, c)


def _kv_b_heads(kv_b: torch.Tensor, num_heads: int, config: MlaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_b's k rows W_uk [Nq, dn, R] and v rows W_uv [Nq, dv, R] (views)."""
    dn = config.qk_nope_head_dim
    w = kv_b.view(num_heads, dn + config.v_head_dim, config.kv_lora_rank)
    return w[:, :dn], w[:, dn:]


def absorb_query(
    q: torch.Tensor,  # [B, Nq, dn + dr]
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    config: MlaConfig,
) -> torch.Tensor:  # [B, Nq, R + dr]
    """[q_nope W_uk, q_rope] per head: the query of attention straight over the latent rows."""
    w_uk, _ = _kv_b_heads(kv_b, q.shape[1], config)
    dn = config.qk_nope_head_dim
    q_lat = torch.matmul(q[..., :dn].transpose(0, 1), w_uk).transpose(0, 1)  # [B, Nq, R]
    return torch.cat([q_lat, q[..., dn:]], dim=-1)


def expand_output(
    o_lat: torch.Tensor,  # [B, Nq, R], attention-weighted latents
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    config: MlaConfig,
) -> torch.Tensor:  # [B, Nq, dv]
    """o_lat W_uv^T per head: the latent-space output back to each head's values."""
    _, w_uv = _kv_b_heads(kv_b, o_lat.shape[1], config)
    return torch.matmul(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def mla_absorbed_kernel(
    q: torch.Tensor,  # [B, Nq, dn + dr], one query token per sequence
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32 (0: a padded row, output 0)
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    config: MlaConfig,
    num_splits: int,
    write=None,  # helios.kernels.mla_decode.LatentWrite: the B rows' latents, written by the first launch
) -> torch.Tensor:  # [B, Nq, dv]
    """mla_absorbed in helios.kernels.mla_decode's three launches (the query absorption with the cache write, the
    attention in float32, the split merge with W_uv): device tensors only, no host read, so it runs inside a CUDA
    graph."""
    from helios.kernels.mla_decode import mla_decode_absorbed

    return mla_decode_absorbed(q, kv_b, cache, block_tables, seq_lens, config.v_head_dim, config.softmax_scale,
                               num_splits, write)


def decode_latent_layout(
    meta: AttentionMetadata, seqs: list[int], page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """blocks [B, nb] int64 and bias [B, 1, nb * page_size] float32 of the one-token sequences `seqs` (indices into
    meta's sequences), derived once per step and shared by every MLA layer."""
    key = ("mla_decode", page_size, tuple(seqs))
    if key not in meta.derived:
        lens = [meta.seq_lens_cpu[i] for i in seqs]
        num_blocks = max(-(-n // page_size) for n in lens)
        device = meta.block_tables.device
        blocks = meta.block_tables[device_tensor(seqs, torch.int64, device), :num_blocks].long()
        allowed = torch.arange(num_blocks * page_size)[None, :] < torch.tensor(lens)[:, None]
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        meta.derived[key] = (blocks, to_device(bias[:, None, :], device))
    return meta.derived[key]


def mla_attention(
    q: torch.Tensor,  # [T, Nq, dn + dr]
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr], this step's latents already written
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    meta: AttentionMetadata,
    config: MlaConfig,
    backend: AttentionBackend | None = None,  # the Triton one: the absorbed attention in its kernel
    write=None,  # a decode-only step's helios.kernels.mla_decode.LatentWrite, not yet in `cache`
) -> torch.Tensor:  # [T, Nq, dv]
    """Every one-token sequence in one absorbed pass over its latent pages; each longer one expanded alone. With a
    backend, a decode-only step reads only device tensors (meta's lengths and tables: graph-safe), and writes its
    latents (`write`) in its first launch."""
    if backend is not None and q.shape[0] == meta.num_seqs:  # every sequence schedules one token
        splits = _decode_splits(backend, max(meta.seq_lens_cpu, default=0), meta.num_seqs, q)
        return mla_absorbed_kernel(q, cache, meta.block_tables, meta.seq_lens, kv_b, config, splits, write)
    assert write is None, "the latents of a step with a prefill are written before attention"
    page_size = cache.shape[2]
    qsl = meta.query_start_loc_cpu
    lengths = [end - start for start, end in zip(qsl, qsl[1:])]
    out = q.new_empty(q.shape[0], q.shape[1], config.v_head_dim)
    singles = list(decode_rows(meta))
    if singles:
        rows = single_rows(meta, singles, q.device)
        if backend is not None:
            tables, lens = decode_rows_layout(meta, singles)
            splits = _decode_splits(backend, max(meta.seq_lens_cpu[i] for i in singles), len(singles), q)
            out[rows] = mla_absorbed_kernel(q[rows], cache, tables, lens, kv_b, config, splits)
        else:
            blocks, bias = decode_latent_layout(meta, singles, page_size)
            out[rows] = mla_absorbed(q[rows], cache, blocks, bias, kv_b, config)
    for i, n in enumerate(lengths):
        if n < 2:
            continue
        seq_len = meta.seq_lens_cpu[i]
        num_blocks = -(-seq_len // page_size)
        pages = meta.block_tables[i, :num_blocks].long()
        cached = cache[0, pages].flatten(0, 1)[:seq_len]  # [S, R + dr]
        out[qsl[i] : qsl[i + 1]] = mla_expanded(q[qsl[i] : qsl[i + 1]], cached, kv_b, config)
    return out


def decode_rows_layout(meta: AttentionMetadata, seqs: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The block tables [B, max_blocks] int32 and lengths [B] int32 of the one-token sequences `seqs` of a mixed step
    (the kernel's inputs), gathered once per step and shared by every MLA layer."""
    key = ("mla_decode_rows", tuple(seqs))
    if key not in meta.derived:
        index = device_tensor(seqs, torch.int64, meta.block_tables.device)
        meta.derived[key] = (meta.block_tables[index], meta.seq_lens[index])
    return meta.derived[key]


def _decode_splits(backend, max_seq_len: int, num_seqs: int, q: torch.Tensor) -> int:
    """The kernel's split count from the lengths and heads, at least the backend's pin (mla_decode.mla_num_splits: a
    graph's count is a constant of its capture metadata)."""
    from helios.kernels.mla_decode import mla_num_splits

    return mla_num_splits(backend.decode_num_splits, max_seq_len, num_seqs, q.shape[1], q.device)


class MlaAttention(nn.Module):
    """Tensors bound (helios/core/layout.py, layers.L.mla.*): in_proj.weight [Q + R + dr, H] (rows q or the q latent,
    the kv latent, the rope key), q_a_norm.weight [Rq] and q_b.weight [Nq*(dn + dr), Rq] with a q latent,
    kv_a_norm.weight [R], kv_b.weight [Nq*(dn + dv), R], o.weight [H, Nq*dv].

    With the Triton backend (`backend`, whose fuses_layers says so) decode attends in helios.kernels.mla_decode and
    the cache write is a kernel that skips padded rows: the layer's decode step then does device work only around
    the backend's pinned split count (attends_through_backend, decode_graph_safe: helios.runner.cuda_graphs)."""

    def __init__(self, hidden_size: int, num_heads: int, config: MlaConfig, switches: Switches = DEFAULT_SWITCHES,
                 backend: AttentionBackend | None = None):
        super().__init__()
        c = config
        self.config = c
        fused = getattr(backend, "fuses_layers", False)
        self.backend = backend if fused else None
        self.attends_through_backend = self.decode_graph_safe = fused
        self.num_heads = num_heads
        self.qk_head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim
        self.q_dim = c.q_lora_rank or num_heads * self.qk_head_dim
        self.in_proj = Linear(hidden_size, self.q_dim + c.kv_lora_rank + c.qk_rope_head_dim, switches=switches)
        if c.q_lora_rank is not None:
            self.q_a_norm = RMSNorm(c.q_lora_rank, c.norm_eps)
            self.q_b = Linear(c.q_lora_rank, num_heads * self.qk_head_dim, switches=switches)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, c.norm_eps)
        self.kv_b = Linear(c.kv_lora_rank, num_heads * (c.qk_nope_head_dim + c.v_head_dim), switches=switches)
        self.o = Linear(num_heads * c.v_head_dim, hidden_size, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cache: torch.Tensor,  # [1, num_pages, page_size, R + dr]
        meta: AttentionMetadata,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None,  # each [T, dr]; None: the rope dims pass as is
    ) -> torch.Tensor:  # [T, H]
        c = self.config
        num_tokens = x.shape[0]
        q, latent, rope_key = self.in_proj(x).split([self.q_dim, c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        if c.q_lora_rank is not None:
            q = self.q_b(self.q_a_norm(q))
        q = q.reshape(num_tokens, self.num_heads, self.qk_head_dim)
        if cos_sin is not None and c.qk_rope_head_dim:
            cos, sin = cos_sin
            dn = c.qk_nope_head_dim
            q = torch.cat([q[..., :dn], apply_rotary(q[..., dn:], cos, sin)], dim=-1)
            rope_key = apply_rotary(rope_key[:, None], cos, sin)[:, 0]
        write = None
        if self.backend is None:
            write_latent(cache, self.kv_a_norm(latent), rope_key, meta.slot_mapping)
        else:
            from helios.kernels.mla_decode import write_latent as write_latent_kernel

            write = self._latent_write(latent, rope_key, meta.slot_mapping)
            if num_tokens != meta.num_seqs:  # a step with a prefill: the write first (else the decode's first launch)
                write_latent_kernel(cache, *write)
                write = None
        o = mla_attention(q, cache, self.kv_b.weight, meta, c, self.backend, write)
        return self.o(o.reshape(num_tokens, self.num_heads * c.v_head_dim))

    def _latent_write(self, latent, rope_key, slot_mapping):
        """The Triton backend's cache write (helios.kernels.mla_decode.LatentWrite), the latent's norm in the write
        where the norm kernel would give its dtype (a weight in that dtype, or multiplied in float32), else first."""
        from helios.kernels.mla_decode import LatentWrite

        norm = self.kv_a_norm
        if (norm.weight is not None and not norm.scale_first
                and (norm.multiply_in_float32 or norm.weight.dtype == latent.dtype)):
            return LatentWrite(latent, rope_key, slot_mapping, norm.weight, norm.eps, norm.multiply_in_float32)
        return LatentWrite(norm(latent), rope_key, slot_mapping)
