"""MiniMax sparse attention (minimax_m3): GQA attention (per-head q/k norms, partial rotary) whose query heads attend
only to the key blocks a lightning indexer selects for their index head: the num_blocks best blocks of block_size keys
by the max of the index scores over each block's visible keys, the query's own (local) blocks always among them
(helios.core.manifest.MsaConfig). The torch reference on every device: per sequence it gathers the pages and index
keys, selects, and attends through SDPA with the selection as the mask. On the Triton backend a decode-only step
(one token per sequence) takes helios.kernels.sparse_decode instead: the same selection with lengths and tables read
on the device, so it is CUDA-graph safe (decode_graph_safe); prefill and mixed steps stay on the torch reference.
Imports torch and helios.layers (helios.kernels on the Triton backend's decode path).

Cache per layer: (kv [2, P, page, Nkv, D], index [1, P, page, Di]) from helios.runner.kv_cache: each token's normed,
rotated index key sits in the same page and slot as its K/V, so it is written, kept and freed with them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import MsaConfig
from helios.layers.attention import Attention, AttentionBackend, AttentionMetadata, write_kv
from helios.layers.linear import Linear
from helios.layers.norm import RMSNorm, norm_rotate_heads
from helios.layers.qsa import attend_masked, indexed_sequences, rotate_leading
from helios.switches import DEFAULT_SWITCHES, Switches


class LightningIndexer(nn.Module):
    """Tensors bound (as attn.indexer.*): qk.weight [(Ni + 1)*Di, H] (rows: the query heads, then the key), q_norm
    and k_norm.weight [Di] (stored 1+w, multiplied in float32)."""

    def __init__(self, hidden_size: int, config: MsaConfig, eps: float, switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        self.config = config
        self.qk = Linear(hidden_size, (config.num_heads + 1) * config.head_dim, switches=switches)
        self.q_norm = RMSNorm(config.head_dim, eps, multiply_in_float32=True)
        self.k_norm = RMSNorm(config.head_dim, eps, multiply_in_float32=True)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False):  # [T, H] ->
        """(queries [T, Ni, Di], keys [T, Di]): normed, then turned at their positions (the keys as the cache keeps
        them); cos/sin [T, r]. fused (the Triton backend): both normed and turned in one launch (norm_rotate_heads:
        the rotation in float32, rounded once)."""
        c = self.config
        qk = self.qk(x).view(x.shape[0], c.num_heads + 1, c.head_dim)  # the query heads, then the key
        if fused:
            q, k = norm_rotate_heads(qk, c.num_heads, self.q_norm, self.k_norm, (cos, sin), True)
            return q, k[:, 0]
        q, k = self.q_norm(qk[:, : c.num_heads]), self.k_norm(qk[:, c.num_heads :])
        return rotate_leading(q, cos, sin), rotate_leading(k, cos, sin)[:, 0]

    def select(
        self,
        q: torch.Tensor,  # [L, Ni, Di] the sequence's index queries of this step
        keys: torch.Tensor,  # [S, Di] its index keys, positions 0 .. S-1 (S = its length after the step)
    ) -> torch.Tensor:  # [L, Ni, S] bool: the keys each query attends to, per index head (causal included)
        """As MiniMaxM3VLIndexer + build_block_mask for a causal sequence: a query at position p scores block b by
        max_{j in b, j <= p} q_h . k_j, boosts its own block and the local_blocks - 1 before it to +inf, keeps the
        best num_blocks blocks (every block it sees when they are fewer) and attends to their keys up to p.
        NOTE: ties go to the earlier block, by a stable sort over every block of the sequence (blocks past p score
        -inf, after every block p sees), so a query's choice depends on its scores only, never on the chunk or batch
        around it; HF's torch.topk breaks ties by its own rule, so the two agree where no tie straddles the cut."""
        c = self.config
        num_queries, seq_len = q.shape[0], keys.shape[0]
        device = q.device
        positions = torch.arange(seq_len - num_queries, seq_len, device=device)
        key_pos = torch.arange(seq_len, device=device)
        causal = key_pos[None, :] <= positions[:, None]  # [L, S]
        num_blocks = -(-seq_len // c.block_size)
        own = positions // c.block_size  # [L] the block each query sits in
        blocks = torch.arange(num_blocks, device=device)
        if num_blocks <= c.num_blocks:
            chosen = (blocks[None, :] <= own[:, None])[:, None, :].expand(-1, c.num_heads, -1)
        else:
            scores = torch.matmul(q.float(), keys.float().t())  # [L, Ni, S]
            scores = scores.masked_fill(~causal[:, None, :], float("-inf"))
            scores = F.pad(scores, (0, num_blocks * c.block_size - seq_len), value=float("-inf"))
            scores = scores.view(num_queries, c.num_heads, num_blocks, c.block_size).amax(dim=-1)  # [L, Ni, nb]
            local = (blocks[None, :] <= own[:, None]) & (blocks[None, :] > (own - c.local_blocks)[:, None])
            scores = scores.masked_fill(local[:, None, :], float("inf"))
            best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : c.num_blocks]
            seen = blocks[None, :] <= own[:, None]  # [L, nb]: past blocks are -inf, never kept
            chosen = torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, best, True) & seen[:, None, :]
        keys_kept = chosen.repeat_interleave(c.block_size, dim=-1)[..., :seq_len]  # [L, Ni, S]
        return keys_kept & causal[:, None, :]


class SparseAttention(Attention):
    """Attention (fused qkv, per-head q/k norms multiplied in float32, partial rotary) whose queries attend only to
    the keys the LightningIndexer selects for their index head. Tensors bound: Attention's (attn.qkv, q_norm,
    k_norm, o) and the indexer's (attn.indexer.*)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, backend: AttentionBackend,
                 config: MsaConfig, eps: float, rotary_dim: int | None, switches: Switches = DEFAULT_SWITCHES):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, backend, qk_norm=True, norm_eps=eps,
                         norm_multiply_in_float32=True, rotary_dim=rotary_dim, switches=switches)
        if num_heads % config.num_heads:
            raise ValueError(f"{num_heads} query heads do not split over {config.num_heads} index heads")
        self.fuses_qkv = False  # the selection runs apart from the backend: no fused backend launch
        self.indexer = LightningIndexer(hidden_size, config, eps, switches)
        # decode-only steps through helios.kernels.sparse_decode: device tensors only (helios.runner.cuda_graphs)
        self.decode_graph_safe = getattr(backend, "fuses_layers", False)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, rotary_dim] at the step's positions
        cache: tuple[torch.Tensor, torch.Tensor],  # kv [2, P, page, Nkv, D], index keys [1, P, page, Di]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens, d = x.shape[0], self.head_dim
        kv_cache, index_cache = cache
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        qkv = self.qkv(x)
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        cos, sin = cos_sin
        if self.fused_ops:  # the Triton backend: q's and k's norms and rotary in one launch
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, d)
            q, k = norm_rotate_heads(qk, self.num_heads, self.q_norm, self.k_norm, cos_sin, True)
        else:
            q = self.q_norm(q.reshape(num_tokens, self.num_heads, d))
            k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, d))
            q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, d)
        index_q, index_k = self.indexer.project(x, cos, sin, self.fused_ops)
        if self.decode_graph_safe and num_tokens == meta.num_seqs:  # every sequence schedules one token
            o = self._decode(q, k, v, index_q, index_k, kv_cache, index_cache, meta)
            return self.o(o.reshape(num_tokens, q_size))
        write_kv(kv_cache, k, v, meta.slot_mapping)
        index_cache.view(-1, index_cache.shape[-1]).index_copy_(0, meta.slot_mapping, index_k.to(index_cache.dtype))
        o = torch.empty(num_tokens, self.num_heads, d, dtype=q.dtype, device=q.device)
        group = self.num_heads // self.indexer.config.num_heads
        for start, end, keys, values, index_keys in indexed_sequences(meta, kv_cache, index_cache):
            mask = self.indexer.select(index_q[start:end], index_keys)  # [L, Ni, S]
            heads = mask.transpose(0, 1).repeat_interleave(group, dim=0)  # [Nq, L, S]: head h reads index head h // G
            o[start:end] = attend_masked(q[start:end], keys, values, heads, self.scale)
        return self.o(o.reshape(num_tokens, q_size))

    def _decode(
        self,
        q: torch.Tensor,  # [B, Nq, D], one token per sequence
        k: torch.Tensor,  # [B, Nkv, D]
        v: torch.Tensor,  # [B, Nkv, D]
        index_q: torch.Tensor,  # [B, Ni, Di]
        index_k: torch.Tensor,  # [B, Di]
        kv_cache: torch.Tensor,  # [2, P, page, Nkv, D]
        index_cache: torch.Tensor,  # [1, P, page, Di]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [B, Nq, D]
        """The decode step in kernels: cache writes that skip padded rows (slot -1), then the block scores, the choice
        (select's, ties to the earlier block) and the attention over the chosen blocks, from meta's device tensors."""
        from helios.kernels import sparse_decode as sd
        from helios.kernels.qsa_decode import top_blocks, write_caches

        c = self.indexer.config
        write_caches(k, v, index_k, kv_cache, index_cache, meta.slot_mapping)  # K/V and the index keys, one launch
        scores = sd.block_scores(index_q, index_cache, meta.block_tables, meta.seq_lens, c.block_size, c.local_blocks)
        chosen = top_blocks(scores, c.num_blocks)  # select's choice (the boost is in the scores), one launch
        return sd.sparse_decode(q, kv_cache, meta.block_tables, meta.seq_lens, chosen, c.block_size, self.scale,
                                sd.sparse_num_splits(c.num_blocks, c.block_size))
