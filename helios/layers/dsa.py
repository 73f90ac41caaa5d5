"""DSA (glm5_next): multi-head latent attention whose queries attend only to the tokens a pooled indexer selects:
the tokens of the best num_pools pools of pool_size keys (each pool's key a learned softmax mix of its tokens' index
keys), and the incomplete tail (helios.core.manifest.DsaConfig). The torch reference on every device: per sequence
it gathers the index rows from their pages and selects; attention is mla.py's, expanded under the selection as a
mask for prefill, absorbed with it as a bias for decode. On the Triton backend a decode-only step (one token per
sequence) takes helios.kernels.dsa_decode instead: the same selection and the absorbed attention over the chosen pools
and the tail, with lengths and tables read on the device, so it is CUDA-graph safe (decode_graph_safe, MLA's); prefill
and mixed steps stay on the torch reference. Imports torch and helios.layers only (helios.kernels on that path).

Cache per layer: (latent [1, P, page, R + dr], index [1, P, page, 2*Di]) from helios.runner.kv_cache: each token's
normed index key and pool-gate logits sit in the same page and slot as its latent, so they are written, kept and
freed with it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import DsaConfig, MlaConfig
from helios.layers.attention import AttentionBackend, AttentionMetadata, decode_rows, single_rows
from helios.layers.linear import Linear, meta_parameter
from helios.layers.mla import MlaAttention, decode_latent_layout, mla_absorbed, mla_expanded, write_latent
from helios.switches import DEFAULT_SWITCHES, Switches

# per sequence of the step: [L, S] bool, the keys each of its L queries attends to (None: empty); a decode-only step
# on the Triton backend: dsa_decode.select_pools' [B, K + 1] int32 pool lists instead (qsa_decode.select_blocks')
Selection = list | torch.Tensor


class DsaIndexer(nn.Module):
    """Tensors bound (as mla.indexer.*): q.weight [Ni*Di, Rq] (from the MLA's normed q latent), in_proj.weight
    [2*Di + Ni, H] (rows: the index key, the pool-gate logits, the head weights), k_norm.weight and .bias [Di] (a
    LayerNorm), pool_bias [pool_size, Di] (the pool-gate logits' learned offset per position in the pool)."""

    def __init__(self, hidden_size: int, q_lora_rank: int, config: DsaConfig,
                 switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        c = config
        self.config = c
        self.q = Linear(q_lora_rank, c.num_heads * c.head_dim, switches=switches)
        self.in_proj = Linear(hidden_size, 2 * c.head_dim + c.num_heads, switches=switches)
        self.k_norm = nn.Module()
        self.k_norm.weight = meta_parameter(c.head_dim)
        self.k_norm.bias = meta_parameter(c.head_dim)
        self.pool_bias = meta_parameter(c.pool_size, c.head_dim)

    def project(self, x: torch.Tensor, q_latent: torch.Tensor):  # x [T, H], q_latent [T, Rq] ->
        """(queries [T, Ni, Di], head weights [T, Ni] float32 with the 1/sqrt(Ni) folded in, the rows the cache keeps
        [T, 2*Di]: the LayerNorm'd key, then the pool-gate logits)."""
        c = self.config
        q, proj = self.project_raw(x, q_latent)
        key, gate, weights = proj.split([c.head_dim, c.head_dim, c.num_heads], dim=-1)
        key = F.layer_norm(key, (c.head_dim,), self.k_norm.weight, self.k_norm.bias, c.key_norm_eps)
        return q, weights.float() * c.num_heads**-0.5, torch.cat([key, gate], dim=-1)

    def project_raw(self, x: torch.Tensor, q_latent: torch.Tensor):  # x [T, H], q_latent [T, Rq] ->
        """(queries [T, Ni, Di], in_proj's rows [T, 2*Di + Ni] as they come: key, gate logits, head weights): project
        before its torch tail, which the decode step folds into dsa_decode.pool_scores (weight_scale, IndexWrite)."""
        c = self.config
        return self.q(q_latent).view(-1, c.num_heads, c.head_dim), self.in_proj(x)

    def select(
        self,
        q: torch.Tensor,  # [L, Ni, Di] the sequence's index queries of this step
        weights: torch.Tensor,  # [L, Ni] float32
        rows: torch.Tensor,  # [S, 2*Di] its cached index rows, positions 0 .. S-1 (S = its length after the step)
    ) -> torch.Tensor:  # [L, S] bool: which keys each query attends to (causal included)
        """As Glm5NextTextIndexer for a causal sequence: a query at position p sees nb = (p+1) // pool_size complete
        pools; it keeps the best num_pools of them (all when nb <= num_pools) and the tail nb * pool_size .. p.
        NOTE: ties (relu makes exact zeros common) go to the earlier pool, by a stable sort, so a query's choice
        depends on its scores only, never on the chunk or batch around it; HF's torch.topk breaks them by its own
        rule, so the two agree where no tie straddles the cut."""
        c = self.config
        num_queries, seq_len = q.shape[0], rows.shape[0]
        device = q.device
        positions = torch.arange(seq_len - num_queries, seq_len, device=device)
        key_pos = torch.arange(seq_len, device=device)
        causal = key_pos[None, :] <= positions[:, None]
        visible = (positions + 1) // c.pool_size  # [L] complete pools each query sees
        num_pools = seq_len // c.pool_size
        if num_pools <= c.num_pools:
            return causal
        size = num_pools * c.pool_size
        keys, gates = rows[:size].view(num_pools, c.pool_size, -1).split(c.head_dim, dim=-1)
        mix = torch.softmax(gates.float() + self.pool_bias.float(), dim=1).to(keys.dtype)  # over the pool's tokens
        pool_keys = (mix * keys).sum(dim=1)  # [nb, Di]
        scores = torch.relu(torch.matmul(q.float(), pool_keys.float().t()) * c.head_dim**-0.5)  # [L, Ni, nb]
        scores = torch.matmul(weights[:, None, :], scores)[:, 0]  # [L, nb]
        seen = torch.arange(num_pools, device=device)[None, :] < visible[:, None]
        scores = scores.masked_fill(~seen, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : c.num_pools]
        chosen = torch.zeros_like(seen).scatter_(1, best, True) & seen  # [L, nb]
        mask = torch.zeros(num_queries, seq_len, dtype=torch.bool, device=device)
        mask[:, :size] = chosen.repeat_interleave(c.pool_size, dim=1)
        return mask | (causal & (key_pos[None, :] >= (visible * c.pool_size)[:, None]))


def dsa_attention(
    q: torch.Tensor,  # [T, Nq, dn + dr]
    cache: torch.Tensor,  # [1, num_pages, page_size, R + dr], this step's latents already written
    kv_b: torch.Tensor,  # [Nq*(dn + dv), R]
    meta: AttentionMetadata,
    config: MlaConfig,
    selection: Selection,
) -> torch.Tensor:  # [T, Nq, dv]
    """mla.mla_attention under the selection: every one-token sequence in one absorbed pass (unselected keys at
    -inf in its bias), each longer one expanded alone with its selection as the mask."""
    page_size = cache.shape[2]
    qsl = meta.query_start_loc_cpu
    lengths = [end - start for start, end in zip(qsl, qsl[1:])]
    out = q.new_empty(q.shape[0], q.shape[1], config.v_head_dim)
    singles = list(decode_rows(meta))
    if singles:
        rows = single_rows(meta, singles, q.device)
        blocks, bias = decode_latent_layout(meta, singles, page_size)
        bias = bias.clone()
        for j, i in enumerate(singles):
            bias[j, 0, : meta.seq_lens_cpu[i]].masked_fill_(~selection[i][0], float("-inf"))
        out[rows] = mla_absorbed(q[rows], cache, blocks, bias, kv_b, config)
    for i, n in enumerate(lengths):
        if n < 2:
            continue
        seq_len = meta.seq_lens_cpu[i]
        pages = meta.block_tables[i, : -(-seq_len // page_size)].long()
        cached = cache[0, pages].flatten(0, 1)[:seq_len]  # [S, R + dr]
        out[qsl[i] : qsl[i + 1]] = mla_expanded(q[qsl[i] : qsl[i + 1]], cached, kv_b, config, selection[i])
    return out


class DsaAttention(MlaAttention):
    """MLA (always with a q latent: the indexer reads it) plus the DSA indexer, or, in a shared layer, none: its
    selection is the previous layer's. Tensors bound: MlaAttention's (layers.L.mla.*) and DsaIndexer's
    (layers.L.mla.indexer.*, full layers only). backend: the Triton one takes decode-only steps through
    helios.kernels.dsa_decode (decode_graph_safe)."""

    def __init__(self, hidden_size: int, num_heads: int, config: MlaConfig, dsa: DsaConfig, shared: bool,
                 switches: Switches = DEFAULT_SWITCHES, backend: AttentionBackend | None = None) -> None:
        if config.q_lora_rank is None:
            raise ValueError("DSA reads the MLA's q latent: q_lora_rank must be set")
        super().__init__(hidden_size, num_heads, config, switches, backend)
        self.dsa = dsa
        self.indexer = None if shared else DsaIndexer(hidden_size, config.q_lora_rank, dsa, switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cache: tuple[torch.Tensor, torch.Tensor],  # latent pages [1, P, page, R + dr], index rows [1, P, page, 2*Di]
        meta: AttentionMetadata,
        previous: Selection | None = None,  # a shared layer's: the selection of the layer before
    ) -> tuple[torch.Tensor, Selection]:  # ([T, H], this layer's selection)
        c = self.config
        num_tokens = x.shape[0]
        latent_cache, index_cache = cache
        q_latent, latent, rope_key = self.in_proj(x).split([self.q_dim, c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q_latent = self.q_a_norm(q_latent)
        q = self.q_b(q_latent).reshape(num_tokens, self.num_heads, self.qk_head_dim)
        if self.indexer is None and previous is None:
            raise ValueError("a shared DSA layer needs the selection of the layer before it")
        if self.decode_graph_safe and num_tokens == meta.num_seqs:  # every sequence schedules one token
            o, selection = self._decode(x, q, q_latent, latent, rope_key, cache, meta, previous)
            return self.o(o.reshape(num_tokens, self.num_heads * c.v_head_dim)), selection
        write_latent(latent_cache, self.kv_a_norm(latent), rope_key, meta.slot_mapping)
        selection = previous if self.indexer is None else self._select(x, q_latent, index_cache, meta)
        o = dsa_attention(q, latent_cache, self.kv_b.weight, meta, c, selection)
        return self.o(o.reshape(num_tokens, self.num_heads * c.v_head_dim)), selection

    def _decode(self, x, q, q_latent, latent, rope_key, cache, meta: AttentionMetadata,
                previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:  # ([B, Nq, dv], pool lists)
        """The decode step in kernels, from meta's device tensors (latent: before kv_a_norm): unless shared, the pool
        scores with the index rows' LayerNorm and write (padded rows, slot -1, write nothing) in one launch, select's
        choice in one; then the absorbed attention over the chosen pools and the tail in three, the latent's norm and
        write in the first (mla_decode_absorbed's form)."""
        from helios.kernels import dsa_decode
        from helios.kernels.qsa_decode import select_blocks

        c, d = self.config, self.dsa
        latent_cache, index_cache = cache
        pools = previous
        if self.indexer is not None:
            index_q, proj = self.indexer.project_raw(x, q_latent)
            k_norm = self.indexer.k_norm
            write = dsa_decode.IndexWrite(proj, k_norm.weight, k_norm.bias, d.key_norm_eps, meta.slot_mapping)
            scores = dsa_decode.pool_scores(index_q, proj[:, 2 * d.head_dim :], index_cache, self.indexer.pool_bias,
                                            meta.block_tables, meta.seq_lens, d.num_heads**-0.5, write)
            pools = select_blocks(scores, meta.seq_lens, d.pool_size, d.num_pools)  # select_pools' lists
        splits = dsa_decode.dsa_num_splits(d.num_pools + 1, d.pool_size)
        o = dsa_decode.sparse_mla_decode_absorbed(q, self.kv_b.weight, latent_cache, meta.block_tables, meta.seq_lens,
                                                  pools, d.pool_size, c.v_head_dim, c.softmax_scale, splits,
                                                  self._latent_write(latent, rope_key, meta.slot_mapping))
        return o, pools

    def _select(self, x, q_latent, index_cache, meta: AttentionMetadata) -> Selection:
        """Write this step's index rows into their slots, then select per sequence over all of its rows."""
        index_q, weights, index_rows = self.indexer.project(x, q_latent)
        flat = index_cache.view(-1, index_cache.shape[-1])
        flat.index_copy_(0, meta.slot_mapping, index_rows.to(index_cache.dtype))
        page_size = index_cache.shape[2]
        qsl = meta.query_start_loc_cpu
        selection: Selection = []
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                selection.append(None)
                continue
            pages = meta.block_tables[i, : -(-seq_len // page_size)].long()
            rows = index_cache[0, pages].flatten(0, 1)[:seq_len]  # [S, 2*Di]
            selection.append(self.indexer.select(index_q[start:end], weights[start:end], rows))
        return selection
