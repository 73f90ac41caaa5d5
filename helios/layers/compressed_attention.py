"""deepseek_v4's attention (helios.core.manifest.CompressedAttentionConfig): shared-KV MQA with per-head sinks over a
sliding window, plus compressed entries (HCA: one per hca_rate tokens; CSA: one per csa_rate tokens from overlapping
windows, each query keeping the index_topk best by a lightning indexer). The torch reference on every device; on the
Triton backend a decode-only step (one token per sequence) takes helios.kernels instead: the ropes in one launch each
(interleaved_rope, reading the tabulated rows), the entry a token completes written by position arithmetic on the
device (csa_compress), CSA's index scores and the reference's stable-sort choice, and the sink attention over the
window and the entries (csa_decode), lengths and tables read on the device, so it is CUDA-graph safe
(decode_graph_safe); prefill and mixed steps stay on the torch reference.

Cache per layer (helios.runner.kv_cache): (rows [1, pages, page_size, raw_dim], entries [1, num_pages, page_size,
entry_row_dim]). Per token its row holds the normed, rotated kv (d values; keys and values alike) and the raw compressor
rows (kv and gate logits; then CSA's indexer kv and gate): only the window ever reads them, so with the engine's window
page group (when the compressors' reach fits the window) they live in its pages. The step that completes a window
computes its entry (CSA: and index key) from the window's rows (CSA: and the previous window's) and spreads it over the
window's last entry_rows rows (group 0, every position's page; all in the page of the window's last token, never a
page shared through the prefix cache): entries are kept, shared by the prefix cache and freed like
any page, with no per-request state (a partial window is simply its last < rate rows), and the arithmetic is the same
whatever the chunking.
Imports torch and helios.core only (and helios.layers' linear, norm and rotary; helios.kernels on that path).
"""

from __future__ import annotations

import torch
from torch import nn

from helios.core.manifest import CompressedAttentionConfig
from helios.layers.attention import AttentionBackend, AttentionMetadata, decode_rows, single_rows
from helios.layers.linear import Linear, meta_parameter
from helios.layers.norm import RMSNorm, rms_norm
from helios.layers.rotary import RotaryEmbedding
from helios.layers.transfer import device_tensor
from helios.switches import DEFAULT_SWITCHES, Switches


class InterleavedRope:
    """deepseek_v4's rope: one frequency per (2i, 2i+1) pair of a head's trailing rope_dim dims (HF's
    DeepseekV4RotaryEmbedding + apply_rotary_pos_emb); the frequencies are helios.layers.rotary's (default or
    yarn), with no attention factor (deepseek_v4 forces it to 1). `rotary` holds them: the model exposes it, so
    tabulate_rope makes its (cos, sin) table, whose first rope_dim / 2 columns are this rope's rows."""

    def __init__(self, rope_dim: int, theta: float, scaling=None, max_positions: int = 0,
                 device: torch.device | str = "cpu"):
        self.rotary = RotaryEmbedding(rope_dim, theta, scaling, max_positions, device)
        self.rotary.attention_scaling = 1.0  # its table's cos/sin then are cos_sin's, bit for bit
        self.inv_freq = self.rotary.inv_freq  # [r/2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, sin) each [N, r/2] in dtype (HF casts them to the activations' dtype)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return freqs.cos().to(dtype), freqs.sin().to(dtype)

    def table(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(cos, sin) [num_positions, r/2] views of the tabulated rows in dtype (no launch), or None (no table)."""
        table = self.rotary.table
        if table is None or table.dtype != dtype:
            return None
        half = self.inv_freq.shape[0]
        return table[:, 0, :half], table[:, 1, :half]


def step_rope(meta: AttentionMetadata, rope: InterleavedRope, dtype: torch.dtype, rate: int = 0):
    """The rope rows helios.kernels' decode launches read, derived once per step and shared by every layer: (cos, sin,
    positions) of the table with the tokens' positions, or, without a table, (cos, sin, None) computed per token.
    rate > 0: for the entry a token's window completes (position p // rate * rate); with a table the kernel finds that
    row itself (positions None is never read)."""
    key = ("interleaved_rope", id(rope), dtype, rate)
    if key not in meta.derived:
        rows = rope.table(dtype)
        if rows is not None:
            meta.derived[key] = (*rows, meta.positions if rate == 0 else None)
        else:
            positions = meta.positions if rate == 0 else meta.positions // rate * rate
            meta.derived[key] = (*rope.cos_sin(positions, dtype), None)
    return meta.derived[key]


def rotate_tail(
    x: torch.Tensor,  # [N, D] or [N, heads, D]
    cos: torch.Tensor,  # [N, r/2]
    sin: torch.Tensor,  # [N, r/2]
) -> torch.Tensor:  # x with its trailing r dims turned, pairs interleaved, in float32 then x's dtype
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    r = cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    pairs = rope.unflatten(-1, (-1, 2))
    rotated_half = torch.stack((-pairs[..., 1], pairs[..., 0]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + rotated_half.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def unit_rms(x: torch.Tensor, eps: float) -> torch.Tensor:  # [..., D]
    """HF's DeepseekV4UnweightedRMSNorm: x times its float32 inverse RMS rounded to x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class Compressor(nn.Module):
    """One compressed series: entries from windows of `rate` rows. Tensors bound: position_bias [rate, w] (the gate
    logits' offset per place in the window), norm.weight [out_dim]; w = out_dim, or 2 * out_dim with `overlap`
    (CSA: a row's first half joins the next window's entry, its second half this window's)."""

    def __init__(self, rate: int, out_dim: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.rate, self.out_dim, self.overlap, self.eps = rate, out_dim, overlap, eps
        self.width = 2 * out_dim if overlap else out_dim
        self.position_bias = meta_parameter(rate, self.width)
        self.norm = nn.Module()
        self.norm.weight = meta_parameter(out_dim)

    def forward(
        self,
        kv: torch.Tensor,  # [(n + e) * rate, w] raw kv rows of whole windows: e = 1 leading window with `overlap`
        gate: torch.Tensor,  # [(n + e) * rate, w] their gate logits            when first > 0, else e = 0
        first: int,  # the window of the first entry asked for
        rope: InterleavedRope,
    ) -> torch.Tensor:  # [n, out_dim]: the entries of windows first .. first + n - 1, rotated at window * rate
        """As DeepseekV4HCACompressor / CSACompressor / the indexer's compressor (softmax over the window's places
        per channel in float32, the mix in the rows' dtype, the RMSNorm, rope). With overlap, entry j mixes window j's
        second halves with window j - 1's first halves (none for window 0: weight 0)."""
        m, d = self.rate, self.out_dim
        lead = 1 if self.overlap and first > 0 else 0
        n = kv.shape[0] // m
        kv = kv.view(n, m, self.width)
        gate = gate.view(n, m, self.width) + self.position_bias
        if self.overlap:
            kv2 = kv.new_zeros(n, 2 * m, d)
            gate2 = gate.new_full((n, 2 * m, d), float("-inf"))
            kv2[:, m:], gate2[:, m:] = kv[..., d:], gate[..., d:]
            kv2[1:, :m], gate2[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
            kv, gate = kv2[lead:], gate2[lead:]  # the leading window only lends its first halves
        return self._mix((torch.arange(n - lead, device=kv.device) + first) * m, kv, gate, rope)

    def _mix(self, positions: torch.Tensor, kv: torch.Tensor, gate: torch.Tensor,
             rope: InterleavedRope) -> torch.Tensor:  # [n], [n, places, d] x2 -> [n, d]
        """The softmax over the window's places per channel in float32, the mix in the rows' dtype, the RMSNorm,
        rope at the window's first position."""
        mixed = (kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1)
        entries = rms_norm(mixed, self.norm.weight, self.eps, multiply_in_float32=True)
        return rotate_tail(entries, *rope.cos_sin(positions, entries.dtype))


class LightningIndexer(nn.Module):
    """CSA's selection. Tensors bound: q_b.weight [Ni*Di, Rq] (from the attention's normed q latent) and its own
    compressor (Compressor with overlap, out Di); its kv, gate and head-weight rows come from the attention's
    in_proj."""

    def __init__(self, config: CompressedAttentionConfig, eps: float, switches: Switches = DEFAULT_SWITCHES):
        super().__init__()
        c = config
        self.config = c
        self.q_b = Linear(c.q_lora_rank, c.index_num_heads * c.index_head_dim, switches=switches)
        self.compressor = Compressor(c.csa_rate, c.index_head_dim, True, eps)

    def select(
        self,
        q: torch.Tensor,  # [B, L, Ni, Di] rotated index queries: B sequences of L queries each
        weights: torch.Tensor,  # [B, L, Ni] float32, the 1/sqrt(Ni) folded in
        keys: torch.Tensor,  # [B, n, Di] their compressed index keys (padded past a sequence's entries)
        visible: torch.Tensor,  # [B, L, n] bool: the entries each query may see (complete windows it follows)
    ) -> torch.Tensor:  # [B, L, n] bool: the entries each query attends to
        """As DeepseekV4Indexer: scores sum_h w_h relu(q_h . k) / sqrt(Di) in float32, the index_topk best of the
        visible entries. NOTE: ties go to the earlier entry (a stable sort), so a choice depends on the query's
        scores only; HF's torch.topk breaks them by its own rule (relu makes exact zeros possible: the tiny test
        configs use enough index heads that no tie reaches the cut)."""
        c = self.config
        scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(1, 2)[:, None]))  # [B, L, Ni, n]
        scores = (scores * c.index_head_dim**-0.5 * weights[..., None]).sum(dim=2)  # [B, L, n]
        scores = scores.masked_fill(~visible, float("-inf"))
        best = torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., : c.index_topk]
        return torch.zeros_like(visible).scatter_(-1, best, True) & visible


def attend_with_sinks(
    q: torch.Tensor,  # [B, L, Nh, d]
    keys: torch.Tensor,  # [B, K, d] keys and values alike
    mask: torch.Tensor,  # [B, L, K] bool: the keys each query attends to
    sinks: torch.Tensor,  # [Nh]
) -> torch.Tensor:  # [B, L, Nh, d]
    """As HF's eager_attention_forward with K = V and head_dim ** -0.5: the sink's logit joins the max and the softmax
    (in float32: HF's sinks stay float32, so its concatenation is float32 whatever the model dtype), then is
    dropped."""
    batch, num_queries, num_heads, d = q.shape
    logits = torch.matmul(q.transpose(1, 2), keys.transpose(1, 2)[:, None]) * d**-0.5  # [B, Nh, L, K]
    logits = logits.masked_fill(~mask[:, None], float("-inf"))
    sink = sinks.float()[None, :, None, None].expand(batch, -1, num_queries, 1)
    combined = torch.cat([logits.float(), sink], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
    return torch.matmul(probs, keys[:, None]).transpose(1, 2)  # [B, L, Nh, d]


_MAX_SCORES = 1 << 26  # float32 scores a prefill block may hold (256 MiB): long contexts run in query blocks


def token_slots(
    tables: torch.Tensor,  # [..., max_blocks] int32: block tables
    positions: torch.Tensor,  # [..., N] int64, positions of each table's sequence
    page_size: int,
) -> torch.Tensor:  # [..., N] int64: the flat slots of those positions
    return tables.gather(-1, positions // page_size).long() * page_size + positions % page_size


def _batch_layout(meta: AttentionMetadata, window: AttentionMetadata, seqs: list[int], num_queries: int,
                  cut: int = 0):
    """(the longest length, lengths [B, 1], block tables [B, max_blocks], window tables [B, max_blocks], query
    positions [B, L]) of the sequences `seqs`, each with num_queries queries ending `cut` tokens before its end (a
    sequence cut there is all those queries see): derived once per step and shared by every layer."""
    key = ("compressed_attention", tuple(seqs), num_queries, cut)
    if key not in meta.derived:
        device = meta.block_tables.device
        ends = [meta.seq_lens_cpu[i] - cut for i in seqs]
        lens = device_tensor(ends, torch.int64, device)[:, None]
        index = device_tensor(seqs, torch.int64, device)
        meta.derived[key] = (max(ends), lens, meta.block_tables[index], window.block_tables[index],
                             lens - num_queries + torch.arange(num_queries, device=device))
    return meta.derived[key]


class CompressedAttention(nn.Module):
    """One deepseek_v4 attention layer of kind "sliding", "hca" or "csa". Tensors bound (layers.L.attn.*):
    in_proj.weight [Rq + d (+ 2w + (4Di + Ni) in csa), H] (rows: the q latent, the kv row, the compressor's kv and
    gate rows (w = d in hca, 2d in csa), csa's indexer kv and gate rows (2Di each) and head weights (Ni)),
    q_a_norm.weight [Rq], q_b.weight [Nh*d, Rq], kv_norm.weight [d], o_a.weight [G*Ro, Nh*d/G], o_b.weight [H, G*Ro],
    sinks [Nh]; compressor.* (hca, csa) and indexer.* (csa)."""

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, kind: str, config: CompressedAttentionConfig,
                 eps: float, switches: Switches = DEFAULT_SWITCHES, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        # decode-only steps through helios.kernels.csa_decode on the Triton backend: device tensors only
        # (decode_graph_safe; attends_through_backend: helios.runner.cuda_graphs reads the backend's name)
        self.backend = backend
        self.attends_through_backend = self.decode_graph_safe = getattr(backend, "fuses_layers", False)
        c = config
        self.config, self.kind, self.eps = c, kind, eps
        self.num_heads, self.head_dim = num_heads, head_dim
        self.rate = {"sliding": 0, "hca": c.hca_rate, "csa": c.csa_rate}[kind]
        self.width = width = {"sliding": 0, "hca": head_dim, "csa": 2 * head_dim}[kind]
        di, ni = (c.index_head_dim, c.index_num_heads) if kind == "csa" else (0, 0)
        self.splits = [c.q_lora_rank, head_dim, width, width, 2 * di, 2 * di, ni]
        self.raw_dim = c.raw_dim(kind, head_dim)
        self.entry_dim = {"sliding": 0, "hca": head_dim, "csa": head_dim + di}[kind]
        self.in_proj = Linear(hidden_size, c.q_lora_rank + head_dim + 2 * width + 4 * di + ni, switches=switches)
        self.q_a_norm = RMSNorm(c.q_lora_rank, eps, multiply_in_float32=True)
        self.q_b = Linear(c.q_lora_rank, num_heads * head_dim, switches=switches)
        self.kv_norm = RMSNorm(head_dim, eps, multiply_in_float32=True)
        self.o_a = Linear(num_heads * head_dim // c.o_groups, c.o_groups * c.o_lora_rank, switches=switches)
        self.o_b = Linear(c.o_groups * c.o_lora_rank, hidden_size, switches=switches)
        self.sinks = meta_parameter(num_heads)
        if kind != "sliding":
            self.compressor = Compressor(self.rate, head_dim, kind == "csa", eps)
        if kind == "csa":
            self.indexer = LightningIndexer(c, eps, switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cache: tuple[torch.Tensor, torch.Tensor],  # rows [1, P_w, page, raw_dim], entries [1, P, page, entry_row]
        meta: AttentionMetadata,
        rope: InterleavedRope,  # this layer's: main (sliding) or compress
        compress_rope: InterleavedRope,
    ) -> torch.Tensor:  # [T, H]
        if self.decode_graph_safe and x.shape[0] == meta.num_seqs:  # every sequence schedules one token
            return self._decode_step(x, cache, meta, rope, compress_rope)
        num_tokens, d = x.shape[0], self.head_dim
        q_lat, kv, c_kv, c_gate, i_kv, i_gate, i_w = self.in_proj(x).split(self.splits, dim=-1)
        q_lat = self.q_a_norm(q_lat)
        cos, sin = rope.cos_sin(meta.positions, x.dtype)
        q = unit_rms(self.q_b(q_lat).view(num_tokens, self.num_heads, d), self.eps)
        q = rotate_tail(q, cos, sin)
        kv = rotate_tail(self.kv_norm(kv), cos, sin)
        window = meta.for_window(self.config.window)  # the rows' pages: the window group's, or every page
        raw = torch.cat([kv, c_kv, c_gate, i_kv, i_gate], dim=-1)
        index = None
        if self.kind == "csa":
            index_q = self.indexer.q_b(q_lat).view(num_tokens, self.config.index_num_heads, -1)
            index = (rotate_tail(index_q, *compress_rope.cos_sin(meta.positions, x.dtype)),
                     i_w.float() * self.config.index_num_heads**-0.5)
        rows, entries = (t.flatten(0, 2) for t in cache)  # [slots, raw_dim], [slots, entry_row_dim]
        rows[window.slot_mapping] = raw.to(rows.dtype)
        out = self._attend_all(q, rows, entries, meta, window, cache[0].shape[2], index, compress_rope)
        # K = V carried the keys' rotation: the output turns back by the query's
        out = rotate_tail(out.to(q.dtype), cos, -sin)
        return self.o_b(self._grouped_o_a(out.reshape(num_tokens, -1)))

    def _decode_step(self, x: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                     rope: InterleavedRope, compress_rope: InterleavedRope) -> torch.Tensor:  # [B, H] -> [B, H]
        """forward's arithmetic for a decode-only step in kernels (helios.kernels.interleaved_rope: unit_rms and the
        rope of q in one launch, kv_norm and the kv's rope too, written over the projection's own kv columns, which
        then are the raw row the cache keeps; the output's rope back), rope rows and positions derived once per step
        (step_rope)."""
        from helios.kernels.interleaved_rope import interleaved_rope

        c, num_tokens, d = self.config, x.shape[0], self.head_dim
        projected = self.in_proj(x)
        q_lat, kv, _, _, _, _, i_w = projected.split(self.splits, dim=-1)
        q_lat = self.q_a_norm(q_lat)
        turn = step_rope(meta, rope, x.dtype)
        q = interleaved_rope(self.q_b(q_lat).view(num_tokens, self.num_heads, d), *turn, norm_eps=self.eps)
        raw = projected[:, c.q_lora_rank : c.q_lora_rank + self.raw_dim]  # kv, then the compressors' kv and gate
        interleaved_rope(kv[:, None], *turn, norm_eps=self.kv_norm.eps, norm_weight=self.kv_norm.weight,
                         out=raw[:, None, :d])  # kv_norm and the rope, over kv's own columns
        index = None
        if self.kind == "csa":
            index_q = self.indexer.q_b(q_lat).view(num_tokens, c.index_num_heads, -1)
            index = (interleaved_rope(index_q, *step_rope(meta, compress_rope, x.dtype)), i_w)  # i_w: unscaled
        out = self._decode(q, raw, cache, meta, meta.for_window(c.window), index, compress_rope)
        # K = V carried the keys' rotation: the output turns back by the query's
        out = interleaved_rope(out.to(q.dtype), *turn, inverse=True)
        return self.o_b(self._grouped_o_a(out.reshape(num_tokens, -1)))

    def _decode(self, q: torch.Tensor, raw: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, window: AttentionMetadata, index,
                compress_rope: InterleavedRope) -> torch.Tensor:  # q [B, Nh, d] -> [B, Nh, d]
        """The decode step in kernels, from meta's device tensors: the row written (padded rows, slot -1, skip), the
        entry of a window this token completes written (by position arithmetic in the kernel, no host branch), then
        (CSA) the index scores and select's choice, and the sink attention over the window and the entries."""
        from helios.kernels import csa_decode
        from helios.kernels.mla_decode import write_latent

        c = self.config
        rows, entries = cache
        write_latent(rows, raw, raw[:, :0], window.slot_mapping)
        r = c.entry_rows(self.kind, rows.shape[2]) if self.rate else 0
        if self.rate:
            self._decode_entries(rows, entries, meta, window, r, compress_rope)
        chosen = None
        if self.kind == "csa":
            scores = csa_decode.index_scores(index[0], index[1], entries, meta.block_tables, meta.seq_lens,
                                             self.rate, r, self.head_dim, c.index_num_heads**-0.5)
            chosen = csa_decode.top_entries(scores, c.index_topk)  # select_entries' choice in one sort
        splits = csa_decode.compressed_num_splits(c.index_topk if chosen is not None else None, c.window)
        return csa_decode.compressed_decode(q, rows, entries, window.block_tables, meta.block_tables, meta.seq_lens,
                                            self.sinks, c.window, self.rate, r, chosen, splits if self.rate else 1)

    def _decode_entries(self, rows: torch.Tensor, entries: torch.Tensor, meta: AttentionMetadata,
                        window: AttentionMetadata, r: int, rope: InterleavedRope) -> None:
        """The entry (CSA: and index key) of window j = p // rate for every row whose token at p completes it ((p + 1)
        % rate == 0, a real row), from its rows (CSA: and window j - 1's), written over its entry rows: one
        helios.kernels.csa_compress launch for the layer's compressors; other rows write nothing."""
        from helios.kernels.csa_compress import Compressed, compress_step

        d, w = self.head_dim, self.width
        main = self.compressor
        compressors = [Compressed(main.position_bias, main.norm.weight, d, 0, main.eps)]
        if self.kind == "csa":
            index = self.indexer.compressor
            compressors.append(Compressed(index.position_bias, index.norm.weight, d + 2 * w, d, index.eps))
        cos, sin, _ = step_rope(meta, rope, rows.dtype, self.rate)
        compress_step(rows, entries, window.block_tables, meta.block_tables, meta.positions, meta.seq_lens, cos, sin,
                      compressors, table=rope.table(rows.dtype) is not None, rate=self.rate, entry_rows=r,
                      overlap=self.kind == "csa", pad_from=self.entry_dim)

    def _attend_all(self, q: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, meta: AttentionMetadata,
                    window: AttentionMetadata, page_size: int, index,
                    compress_rope: InterleavedRope) -> torch.Tensor:  # q [T, Nh, d] -> [T, Nh, d]
        """The entries of the windows this step completes, then attention: every one-token sequence in one batched
        pass (padded to the longest), each longer one alone."""
        qsl = meta.query_start_loc_cpu
        lengths = [end - start for start, end in zip(qsl, qsl[1:])]
        if self.rate:
            for i, seq_len in enumerate(meta.seq_lens_cpu):
                if lengths[i]:
                    self._write_entries(rows, entries, window.block_tables[i], meta.block_tables[i], page_size,
                                        seq_len - lengths[i], seq_len, compress_rope)
        singles = list(decode_rows(meta))
        groups = [(singles, single_rows(meta, singles, q.device))] if singles else []
        groups += [([i], torch.arange(qsl[i], qsl[i + 1], device=q.device)) for i, n in enumerate(lengths) if n > 1]
        out = torch.empty_like(q)
        for seqs, at in groups:
            for rows_at, cut in self._query_blocks(seqs, at, meta):
                shape = (len(seqs), -1)  # [B, L]
                seq_index = None if index is None else tuple(t[rows_at].unflatten(0, shape) for t in index)
                layout = _batch_layout(meta, window, seqs, len(rows_at) // len(seqs), cut)
                o = self._attend(q[rows_at].unflatten(0, shape), rows, entries, layout, page_size, seq_index)
                out[rows_at] = o.flatten(0, 1)
        return out

    def _query_blocks(self, seqs: list[int], at: torch.Tensor, meta: AttentionMetadata) -> list[tuple]:
        """[(rows, the sequence's queries after them)]: one block for the one-token sequences; a prefill in blocks of
        queries, so the scores it materialises stay under _MAX_SCORES."""
        if len(seqs) > 1:
            return [(at, 0)]
        size = max(1, _MAX_SCORES // self._scores_per_query(meta.seq_lens_cpu[seqs[0]]))
        return [(at[s : s + size], max(0, len(at) - s - size)) for s in range(0, len(at), size)]

    def _scores_per_query(self, seq_len: int) -> int:
        """Scores one query materialises: a logit per head and key (window and entries), an index score per index
        head and entry."""
        entries = seq_len // self.rate if self.rate else 0
        index_heads = self.config.index_num_heads if self.kind == "csa" else 0
        return self.num_heads * (self.config.window + entries) + index_heads * entries

    def _write_entries(self, rows: torch.Tensor, entries: torch.Tensor, window_table: torch.Tensor,
                       table: torch.Tensor, page_size: int, start: int, seq_len: int, rope: InterleavedRope) -> None:
        """The entries of the windows this step completes (positions start .. seq_len - 1 are new; their rows are
        written), from their rows (CSA: and the previous window's), spread over each window's entry rows."""
        m, d, w = self.rate, self.head_dim, self.width
        first, end = start // m, seq_len // m
        if end <= first:
            return
        lead = 1 if self.kind == "csa" and first > 0 else 0
        device = rows.device
        raw = rows[token_slots(window_table, torch.arange((first - lead) * m, end * m, device=device), page_size)]
        new = [self.compressor(raw[:, d : d + w], raw[:, d + w : d + 2 * w], first, rope)]
        if self.kind == "csa":
            at, wi = d + 2 * w, 2 * self.config.index_head_dim
            new.append(self.indexer.compressor(raw[:, at : at + wi], raw[:, at + wi : at + 2 * wi], first, rope))
        r, e = self.config.entry_rows(self.kind, page_size), entries.shape[-1]
        new = torch.nn.functional.pad(torch.cat(new, dim=-1), (0, r * e - self.entry_dim)).view(-1, e)  # [n*r, e]
        at = self._entry_positions(torch.arange(first, end, device=device), r).flatten()
        entries[token_slots(table, at, page_size)] = new.to(entries.dtype)

    def _entry_positions(self, windows: torch.Tensor, r: int) -> torch.Tensor:  # [..., n] -> [..., n, r]
        """The rows holding each window's entry: its last r (config.entry_rows)."""
        m = self.rate
        return (windows * m + m - r)[..., None] + torch.arange(r, device=windows.device)

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, entries: torch.Tensor, layout, page_size: int,
                index) -> torch.Tensor:  # q [B, L, Nh, d] -> [B, L, Nh, d]
        """B sequences' last L queries each (B one-token sequences, or one sequence): their window keys and their
        compressed entries (padded to the longest; padding masked) under the causal / window / selection mask."""
        c, d, num_queries, device = self.config, self.head_dim, q.shape[1], q.device
        max_len, lens, tables, window_tables, positions = layout
        span = min(max_len, num_queries + c.window - 1)  # keys any query's window holds
        key_pos = lens - span + torch.arange(span, device=device)  # [B, span], < 0: padding
        keys = [rows[token_slots(window_tables, key_pos.clamp(min=0), page_size), :d]]
        kp, qp = key_pos[:, None, :], positions[..., None]
        masks = [(kp >= 0) & (kp <= qp) & (kp > qp - c.window)]  # [B, L, span]
        n = max_len // self.rate if self.rate else 0
        if n:
            m, r, e = self.rate, c.entry_rows(self.kind, page_size), entries.shape[-1]
            windows = torch.arange(n, device=device)
            at = self._entry_positions(torch.where(windows < lens // m, windows, 0), r)  # [B, n, r]; padding: 0
            share = entries[token_slots(tables, at.flatten(1), page_size)]  # [B, n*r, e]
            compressed = share.view(share.shape[0], n, r * e)[..., : self.entry_dim]  # [B, n, d (+ Di)]
            keys.append(compressed[..., :d])
            visible = windows < (qp + 1) // m  # [B, L, n]: the windows that end at or before each query
            if index is not None:
                visible = self.indexer.select(index[0], index[1], compressed[..., d:], visible)
            masks.append(visible)
        return attend_with_sinks(q, torch.cat(keys, dim=1).to(q.dtype), torch.cat(masks, dim=-1), self.sinks)

    def _grouped_o_a(self, o: torch.Tensor) -> torch.Tensor:  # [T, Nh*d] -> [T, G*Ro]
        """HF's DeepseekV4GroupedLinear: group g of heads through its own [Ro, Nh*d/G] block of o_a."""
        groups = self.config.o_groups
        w = self.o_a.weight.view(groups, -1, o.shape[-1] // groups)  # [G, Ro, in]
        y = torch.bmm(o.view(o.shape[0], groups, -1).transpose(0, 1), w.transpose(1, 2))  # [G, T, Ro]
        return y.transpose(0, 1).reshape(o.shape[0], -1)
