"""QSA (qwen4_exp): gated attention whose queries attend only to the tokens an indexer selects: the tokens of the
top blocks of block_size keys by sum_h relu(q_h . k_block), and the incomplete tail (helios.core.manifest.
IndexerConfig). The torch reference on every device: it gathers each sequence's pages and index keys, selects, and
attends through SDPA with the selection as the mask. On the Triton backend a decode-only step (one token per
sequence) takes helios.kernels.qsa_decode instead: the same selection with lengths and tables read on the device, so
it is CUDA-graph safe (decode_graph_safe); prefill and mixed steps stay on the torch reference. On that backend every
step also takes q's and k's norms and partial rotary in one launch, the index queries' in another (inside the block
scores' launch at decode), and the output gate in a third, each with the torch path's roundings. Imports torch and helios.layers only (helios.kernels on the Triton
backend's path).

Cache per layer: (kv [2, P, page, Nkv, D], index [1, P, page, Di]) from helios.runner.kv_cache: the raw index key
of every token sits in the same page and slot as its K/V, so it is written, kept and freed with them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from helios.core.manifest import IndexerConfig
from helios.layers.attention import AttentionBackend, AttentionMetadata, write_kv
from helios.layers.linear import Linear
from helios.layers.norm import RMSNorm, norm_rotate_heads
from helios.layers.recurrent import sigmoid
from helios.layers.rotary import RotaryEmbedding, apply_rotary
from helios.switches import DEFAULT_SWITCHES, Switches


def rotate_leading(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary over the leading cos.shape[-1] dims of each head, the rest passed: [T, heads, d], cos/sin [T, r]."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]], dim=-1)


class Indexer(nn.Module):
    """Tensors bound (as attn.indexer.*): qk.weight [(Ni + 1)*Di, H] (rows: the query heads, then the key), q_norm
    and k_norm.weight [Di] (stored 1+w, multiplied in float32)."""

    def __init__(self, hidden_size: int, config: IndexerConfig, eps: float, rotary: RotaryEmbedding,
                 switches: Switches = DEFAULT_SWITCHES) -> None:
        super().__init__()
        self.config = config
        self.rotary = rotary  # the attention's: block keys turn at their first position
        self.qk = Linear(hidden_size, (config.num_heads + 1) * config.head_dim, switches=switches)
        self.q_norm = RMSNorm(config.head_dim, eps, multiply_in_float32=True)
        self.k_norm = RMSNorm(config.head_dim, eps, multiply_in_float32=True)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool = False):  # [T, H] ->
        """(queries [T, Ni, Di] normed and turned, raw keys [T, Di]: what the cache keeps). fused (the Triton
        backend): the queries' norm and rotary in one launch (norm_rotate_heads, apply_rotary's roundings)."""
        q, k = self.project_raw(x)
        if fused:
            return norm_rotate_heads(q, q.shape[1], self.q_norm, None, (cos, sin), True, round_products=True)[0], k
        return rotate_leading(self.q_norm(q), cos, sin), k

    def project_raw(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [T, H] ->
        """(queries [T, Ni, Di] before their norm and rotary, raw keys [T, Di]): views of the projection's output."""
        c = self.config
        q, k = self.qk(x).split([c.num_heads * c.head_dim, c.head_dim], dim=-1)
        return q.view(x.shape[0], c.num_heads, c.head_dim), k

    def block_keys(self, groups: torch.Tensor) -> torch.Tensor:  # [nb, block_size, Di] raw keys -> [nb, Di]
        """Block b's key: its raw keys' float32 mean in their dtype, k-normed, turned at its first position b *
        block_size."""
        num_blocks, block_size = groups.shape[:2]
        block_keys = self.k_norm(groups.float().mean(dim=1).to(groups.dtype))
        cos, sin = self.rotary.cos_sin(torch.arange(num_blocks, device=groups.device) * block_size, groups.dtype)
        return rotate_leading(block_keys[:, None, :], cos, sin)[:, 0]

    def select(
        self,
        q: torch.Tensor,  # [L, Ni, Di] the sequence's queries of this step
        keys: torch.Tensor,  # [S, Di] raw index keys of its positions 0 .. S-1 (S = its length after the step)
        first_pos: int,  # position of q's first row
    ) -> torch.Tensor:  # [L, S] bool: which keys each query attends to (causal included)
        """As Qwen4ExpTextQSAIndexer._select_tokens for a causal sequence: a query at position p sees nb = (p+1) //
        block_size complete blocks; it keeps the best num_blocks of them (all when nb <= num_blocks) and the tail
        nb * block_size .. p. NOTE: relu makes exact zero scores common (every index head negative), so the tie
        rule matters: ties go to the earlier block, by a stable sort over the blocks the last query sees (blocks a
        query does not see score -inf, after all it sees), so a query's choice depends on its own scores only, never
        on the chunk, batch or device around it (helios.kernels.qsa_decode chooses alike). HF's torch.topk breaks ties
        by its own, device-dependent rule; the two agree where no tie straddles the cut."""
        c = self.config
        num_queries, seq_len = q.shape[0], keys.shape[0]
        device = q.device
        positions = torch.arange(first_pos, first_pos + num_queries, device=device)
        key_pos = torch.arange(seq_len, device=device)
        causal = key_pos[None, :] <= positions[:, None]
        num_blocks = (first_pos + num_queries) // c.block_size  # the complete blocks the last query sees
        if num_blocks <= c.num_blocks:
            return causal
        visible = (positions + 1) // c.block_size  # [L]
        block_keys = self.block_keys(keys[: num_blocks * c.block_size].view(num_blocks, c.block_size, -1))
        scores = torch.matmul(q.float(), block_keys.float().t())  # [L, Ni, nb]
        scores = torch.relu(scores).sum(dim=1) / math.sqrt(c.head_dim)  # [L, nb]
        seen = torch.arange(num_blocks, device=device)[None, :] < visible[:, None]  # [L, nb]
        scores = scores.masked_fill(~seen, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : c.num_blocks]
        chosen = torch.zeros_like(seen).scatter_(1, best, True) & seen
        in_block = chosen.repeat_interleave(c.block_size, dim=1)  # [L, nb * block_size]
        mask = torch.zeros(num_queries, seq_len, dtype=torch.bool, device=device)
        mask[:, : in_block.shape[1]] = in_block
        tail_start = visible * c.block_size
        return mask | (causal & (key_pos[None, :] >= tail_start[:, None]))


class IndexedAttention(nn.Module):
    """qwen3_5's gated attention (per-head q/k norms, partial rotary, sigmoid output gate) over the keys the
    Indexer selects. Tensors bound: qkv.weight [(2*Nq + 2*Nkv)*D, H] (rows q, k, v, gate), q_norm / k_norm.weight
    [D], o.weight [H, Nq*D], and the Indexer's. backend: the Triton one takes decode-only steps through
    helios.kernels.qsa_decode (decode_graph_safe)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, config: IndexerConfig,
                 eps: float, rotary: RotaryEmbedding, switches: Switches = DEFAULT_SWITCHES,
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.backend = backend
        # decode-only steps through helios.kernels.qsa_decode: device tensors only (decode_graph_safe;
        # attends_through_backend: helios.runner.cuda_graphs reads the backend's name)
        self.attends_through_backend = self.decode_graph_safe = getattr(backend, "fuses_layers", False)
        # every step: the q/k norms with the rotary, the index queries' and the output gate one launch each
        self.fused_ops = self.decode_graph_safe
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.qkv = Linear(hidden_size, (2 * num_heads + 2 * num_kv_heads) * head_dim, switches=switches)
        self.q_norm = RMSNorm(head_dim, eps, multiply_in_float32=True)
        self.k_norm = RMSNorm(head_dim, eps, multiply_in_float32=True)
        self.o = Linear(num_heads * head_dim, hidden_size, switches=switches)
        self.indexer = Indexer(hidden_size, config, eps, rotary, switches)

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
        q, k, v, gate = qkv.split([q_size, kv_size, kv_size, q_size], dim=-1)
        cos, sin = cos_sin
        if self.fused_ops:  # q and k are adjacent heads of the projection's output
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, d)
            q, k = norm_rotate_heads(qk, self.num_heads, self.q_norm, self.k_norm, cos_sin, True, round_products=True)
        else:
            q = rotate_leading(self.q_norm(q.reshape(num_tokens, self.num_heads, d)), cos, sin)
            k = rotate_leading(self.k_norm(k.reshape(num_tokens, self.num_kv_heads, d)), cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, d)
        if self.decode_graph_safe and num_tokens == meta.num_seqs:  # every sequence schedules one token
            index_q, index_k = self.indexer.project_raw(x)  # the block scores norm and turn the queries
            o = self._decode(q, k, v, index_q, index_k, cos_sin, kv_cache, index_cache, meta).to(q.dtype)
        else:
            index_q, index_k = self.indexer.project(x, cos, sin, self.fused_ops)
            write_kv(kv_cache, k, v, meta.slot_mapping)
            index_cache.view(-1, index_cache.shape[-1]).index_copy_(0, meta.slot_mapping,
                                                                  index_k.to(index_cache.dtype))
            o = torch.empty(num_tokens, self.num_heads, d, dtype=q.dtype, device=q.device)
            for start, end, keys, values, index_keys in indexed_sequences(meta, kv_cache, index_cache):
                mask = self.indexer.select(index_q[start:end], index_keys, keys.shape[0] - (end - start))
                o[start:end] = attend_masked(q[start:end], keys, values, mask, self.scale)
        if self.fused_ops:  # torch's sigmoid and product, their roundings, in one launch
            from helios.kernels.output_gate import sigmoid_gate

            return self.o(sigmoid_gate(o.reshape(num_tokens, q_size), gate))
        o = o.reshape(num_tokens, q_size) * sigmoid(gate)  # exp-based: the same bits at every row offset
        return self.o(o)

    def _decode(
        self,
        q: torch.Tensor,  # [B, Nq, D], one token per sequence
        k: torch.Tensor,  # [B, Nkv, D]
        v: torch.Tensor,  # [B, Nkv, D]
        index_q: torch.Tensor,  # [B, Ni, Di] raw (before the indexer's q_norm and rotary)
        index_k: torch.Tensor,  # [B, Di] raw
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [B, rotary_dim] at the step's positions
        kv_cache: torch.Tensor,  # [2, P, page, Nkv, D]
        index_cache: torch.Tensor,  # [1, P, page, Di]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [B, Nq, D] in the cache's dtype
        """The decode step in kernels: cache writes that skip padded rows (slot -1), then the block scores, select's
        choice (ties to the earlier block) plus the tail, and the attention over them, from meta's device tensors."""
        from helios.kernels import qsa_decode

        indexer, c = self.indexer, self.indexer.config
        qsa_decode.write_caches(k, v, index_k, kv_cache, index_cache, meta.slot_mapping)  # K/V and raw index keys
        num_blocks = qsa_decode.block_count(meta.block_tables.shape[1], index_cache.shape[2], c.block_size)
        cos, sin = block_cos_sin(meta, indexer.rotary, num_blocks, c.block_size, index_cache.dtype)
        q_norm = indexer.q_norm  # multiplied in float32, as block_scores folds it
        scores = qsa_decode.block_scores(index_q, index_cache, indexer.k_norm.weight, indexer.k_norm.eps, cos, sin,
                                         meta.block_tables, meta.seq_lens, c.block_size, q_norm_weight=q_norm.weight,
                                         q_eps=q_norm.eps, q_cos=cos_sin[0], q_sin=cos_sin[1])
        blocks = qsa_decode.select_blocks(scores, meta.seq_lens, c.block_size, c.num_blocks)
        return qsa_decode.qsa_decode(q, kv_cache, meta.block_tables, meta.seq_lens, blocks, c.block_size, self.scale)


def block_cos_sin(
    meta: AttentionMetadata,
    rotary: RotaryEmbedding,
    num_blocks: int,  # the step's static block count (qsa_decode.block_count)
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:  # each [num_blocks, rotary_dim], rows of unit last stride
    """The rotary rows at each block's first position (block_starts), derived once per step and shared by every
    layer: every block_size-th row of the rope table (a view: no launch) where the table holds them all, else gathered
    as cos_sin gathers a step's rows."""
    key = ("qsa_block_cos_sin", id(rotary), num_blocks, block_size, dtype)
    if key not in meta.derived:
        table = rotary.table
        if table is not None and table.dtype == dtype and (num_blocks - 1) * block_size < table.shape[0]:
            rows = table[: num_blocks * block_size : block_size]  # [num_blocks, 2, rotary_dim]
            meta.derived[key] = (rows[:, 0], rows[:, 1])
        else:
            device = meta.block_tables.device
            meta.derived[key] = rotary.cos_sin(block_starts(rotary, num_blocks, block_size, device), dtype)
    return meta.derived[key]


def block_starts(rotary: RotaryEmbedding, num_blocks: int, block_size: int, device) -> torch.Tensor:  # [nb] int64
    """Each block's first position, for a step's static block count (its table's width): positions past the rotary
    table (blocks no sequence completes; their scores are -inf) read its last row instead of out of range."""
    starts = torch.arange(num_blocks, device=device) * block_size
    return starts if rotary.table is None else starts.clamp(max=rotary.table.shape[0] - 1)


def indexed_sequences(meta: AttentionMetadata, kv_cache: torch.Tensor, index_cache: torch.Tensor):
    """Per sequence of the step with queries: (start, end, keys [S, Nkv, D], values [S, Nkv, D], index keys
    [S, Di]), its query rows and everything its pages hold up to its length S (this step's writes included)."""
    page_size = kv_cache.shape[2]
    qsl = meta.query_start_loc_cpu
    for i, seq_len in enumerate(meta.seq_lens_cpu):
        if qsl[i + 1] == qsl[i]:
            continue
        pages = meta.block_tables[i, : -(-seq_len // page_size)].long()
        yield (qsl[i], qsl[i + 1], kv_cache[0, pages].flatten(0, 1)[:seq_len],
               kv_cache[1, pages].flatten(0, 1)[:seq_len], index_cache[0, pages].flatten(0, 1)[:seq_len])


def attend_masked(
    q: torch.Tensor,  # [L, Nq, D]
    keys: torch.Tensor,  # [S, Nkv, D]
    values: torch.Tensor,  # [S, Nkv, D]
    mask: torch.Tensor,  # [L, S] or [Nq, L, S] bool: the keys each query (of each head) attends to
    scale: float,
) -> torch.Tensor:  # [L, Nq, D]
    """SDPA of one sequence's queries over its keys under a selection mask (GQA without repeating K/V)."""
    # 4-d operands: CPU SDPA's flash kernel (helios.layers.attention._attend says why)
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.to(q.dtype).transpose(0, 1)[None],
                                       values.to(q.dtype).transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != keys.shape[1])
    return o[0].transpose(0, 1)
