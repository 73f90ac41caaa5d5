"""Paged attention: the per-step metadata, the backend facade, and the attention layer.

The layer projects q/k/v, applies q/k norms and rotary, then hands everything to an `AttentionBackend`
chosen once per model (`select_attention_backend`), which writes this step's K/V into the paged cache
and attends over each sequence's pages. No globals: the metadata is an argument of every forward.
Imports torch and helios.core only; a Triton backend lives in helios.kernels and is imported lazily.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from helios.layers.linear import Linear, meta_parameter
from helios.layers.norm import RMSNorm, norm_rotate_heads
from helios.layers.rotary import apply_rotary
from helios.layers.transfer import device_tensor
from helios.switches import DEFAULT_SWITCHES, Switches


@dataclass(frozen=True)
class AttentionMetadata:
    """Where this step's tokens sit: one flattened batch of B sequences, T tokens in all.

    Sequence i owns tokens query_start_loc[i]:query_start_loc[i+1]; they are its last query tokens, so
    its first query position is seq_lens[i] - num_query_tokens (chunked prefill and decode alike).
    The *_cpu lists mirror the tensors for host-side loops (no device sync). The sliding window is
    per layer, so each Attention layer passes its own (from arch.layer_types) to the backend call; with a window
    page group (helios/engine/kv_groups.py) a layer of that window also reads its group's tables (for_window).
    """

    positions: torch.Tensor  # [T] int64, absolute position of each token
    slot_mapping: torch.Tensor  # [T] int64, block_id * page_size + offset; the KV write target
    query_start_loc: torch.Tensor  # [B + 1] int32, cumulative query token counts
    seq_lens: torch.Tensor  # [B] int32, KV length of each sequence after this step's writes
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0 past each table's end
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    # hybrid models: each sequence's row of the recurrent layers' state (helios.layers.linear_attention); the
    # state is read only for a sequence with earlier tokens (its first position > 0)
    state_slots: torch.Tensor | None = None  # [B] int32
    state_slots_cpu: list[int] = field(default_factory=list)
    # n-gram models (qwen4_exp's PLE): each sequence's n tokens before its first scheduled one, oldest first, the
    # model's reset token standing for those before position 0 (the runner holds every request's tokens)
    context_token_ids: torch.Tensor | None = None  # [B, n] int64
    # window page groups: window -> (block_tables [B, max_blocks] int32, slot_mapping [T] int64) of the pages the
    # layers of that window keep apart (entries before a sequence's window are page 0, never read); empty: every
    # layer uses block_tables and slot_mapping above
    window_groups: dict = field(default_factory=dict)
    # NOTE: per-step values a backend derives from the fields above once and reuses in every layer (the CPU
    # decode gather and mask); the metadata lives for one step, so nothing here outlives its inputs.
    derived: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    def for_window(self, sliding_window: int | None) -> AttentionMetadata:
        """The metadata a layer of this window reads: its page group's block tables and slot mapping, when it keeps
        its pages apart; else this one. One view per step and group (derived), so per-step values derived from it
        are derived once."""
        group = self.window_groups.get(sliding_window) if sliding_window is not None else None
        if group is None:
            return self
        key = ("window", sliding_window)
        if key not in self.derived:
            self.derived[key] = replace(self, block_tables=group[0], slot_mapping=group[1], window_groups={},
                                        derived={})
        return self.derived[key]


def single_rows(meta: AttentionMetadata, seqs: list[int], device: torch.device) -> torch.Tensor:  # [len(seqs)] int64
    """The token rows of the one-token sequences `seqs` of a mixed step, on the device once per step for every layer
    (helios.layers.transfer: no stream sync)."""
    key = ("single_rows", tuple(seqs))
    if key not in meta.derived:
        qsl = meta.query_start_loc_cpu
        meta.derived[key] = device_tensor([qsl[i] for i in seqs], torch.int64, device)
    return meta.derived[key]


def rows_of(meta: AttentionMetadata, seqs: list[int]) -> list[int]:
    """The token rows of sequences `seqs` of the step, in their order."""
    qsl = meta.query_start_loc_cpu
    return [row for i in seqs for row in range(qsl[i], qsl[i + 1])]


def row_index(rows: list[int], device: torch.device) -> slice | torch.Tensor:
    """Rows as an index: a slice when they are one ascending run (a view, no copy), else an int64 device tensor."""
    if rows and rows == list(range(rows[0], rows[0] + len(rows))):
        return slice(rows[0], rows[0] + len(rows))
    return device_tensor(rows, torch.int64, device)


def subset(meta: AttentionMetadata, seqs: list[int]) -> tuple[slice | torch.Tensor, AttentionMetadata]:
    """Sequences `seqs` of a step as a step of their own: (their token rows in this step, as row_index gives them;
    their metadata, tokens renumbered from 0 in that order), for a layer that runs a part of the step apart
    (helios.layers.linear_attention.mixed_rows). Made once per step and subset (derived)."""
    key = ("subset", tuple(seqs))
    if key in meta.derived:
        return meta.derived[key]
    device = meta.query_start_loc.device
    qsl = meta.query_start_loc_cpu
    sub_qsl = [0]
    for i in seqs:
        sub_qsl.append(sub_qsl[-1] + qsl[i + 1] - qsl[i])
    rows, index = row_index(rows_of(meta, seqs), device), device_tensor(seqs, torch.int64, device)
    sub = replace(
        meta, positions=meta.positions[rows], slot_mapping=meta.slot_mapping[rows],
        query_start_loc=device_tensor(sub_qsl, torch.int32, device), seq_lens=meta.seq_lens[index],
        block_tables=meta.block_tables[index], query_start_loc_cpu=sub_qsl,
        seq_lens_cpu=[meta.seq_lens_cpu[i] for i in seqs],
        state_slots=meta.state_slots[index] if meta.state_slots is not None else None,
        state_slots_cpu=[meta.state_slots_cpu[i] for i in seqs] if meta.state_slots_cpu else [],
        context_token_ids=meta.context_token_ids[index] if meta.context_token_ids is not None else None,
        window_groups={w: (tables[index], slots[rows]) for w, (tables, slots) in meta.window_groups.items()},
        derived={})
    meta.derived[key] = rows, sub
    return rows, sub


class AttentionBackend(Protocol):
    """What a layer needs from an attention implementation; one instance serves every layer."""

    name: str

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
        sinks: torch.Tensor | None = None,  # [num_heads] float32 sink logits (mimo_v2_flash)
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v at meta.slot_mapping, then attend causally over each sequence's cached keys; with sinks, each
        head's softmax denominator also counts exp(sink) (a key every query sees, whose value is 0)."""
        ...


def write_kv(
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, num_kv_heads, head_dim]
    k: torch.Tensor,  # [T, num_kv_heads, head_dim]
    v: torch.Tensor,  # [T, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [T] int64
) -> None:
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])  # [2, num_slots, Nkv, D]
    flat[0].index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


class TorchAttentionBackend:
    """Reference backend for CPU (and any device): gather each sequence's pages, then SDPA.

    Decode rows (a sequence with one query token) without a soft-cap, in float32 or in any dtype on the CPU,
    attend together over one padded gather (`decode_attention`: in float32, or SDPA's flash kernel for 16-bit
    pages on the CPU), in a decode-only step and beside the prompt chunks of a mixed one alike (so a decode
    token's logits do not depend on what shares its step); the prompt chunks loop over sequences.
    Keys older than the sliding window are not gathered at all, so a sliding layer's cost stays
    bounded by the window rather than the context.
    """

    name = "torch"

    def forward(self, q, k, v, kv_cache, meta, scale, sliding_window, softcap, sinks=None):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        page_size = kv_cache.shape[2]
        batched = softcap is None and (q.dtype == torch.float32 or q.device.type == "cpu")
        if batched and q.shape[0] == meta.num_seqs:
            blocks, bias = decode_layout(meta, page_size, sliding_window)
            return decode_attention(q, kv_cache, blocks, bias, scale, sinks)
        out = torch.empty_like(q)
        qsl = meta.query_start_loc_cpu
        rows = decode_rows(meta) if batched else ()
        if rows:
            blocks, bias = decode_layout(meta, page_size, sliding_window, rows)
            tokens = single_rows(meta, list(rows), q.device)
            out.index_copy_(0, tokens, decode_attention(q.index_select(0, tokens), kv_cache, blocks, bias, scale,
                                                        sinks))
        for i, seq_len in enumerate(meta.seq_lens_cpu):
            start, end = qsl[i], qsl[i + 1]
            if end - start <= (1 if rows else 0):  # no query, or a decode row attended above
                continue
            first_pos = seq_len - (end - start)  # position of this sequence's first query token
            # keys [key_start, seq_len): everything a query may see (window start of the first query)
            key_start = 0 if sliding_window is None else max(0, first_pos - sliding_window + 1)
            first_block = key_start // page_size
            num_blocks = (seq_len + page_size - 1) // page_size - first_block
            blocks = meta.block_tables[i, first_block : first_block + num_blocks].long()
            base = first_block * page_size
            # index_select, not kv_cache[0, blocks]: the same copy, ~2x faster on the CPU at a chunk's ~10 pages
            keys = kv_cache[0].index_select(0, blocks).flatten(0, 1)[key_start - base : seq_len - base]  # [S, Nkv, D]
            values = kv_cache[1].index_select(0, blocks).flatten(0, 1)[key_start - base : seq_len - base]
            mask = _mask(first_pos, end - start, key_start, seq_len, sliding_window, q.device)
            out[start:end] = _attend(q[start:end], keys, values, mask, scale, softcap, sinks)
        return out


def decode_rows(meta: AttentionMetadata) -> tuple[int, ...]:
    """The sequences of a step that decode (exactly one query token), derived once per step."""
    if "decode_rows" not in meta.derived:
        qsl = meta.query_start_loc_cpu
        meta.derived["decode_rows"] = tuple(i for i in range(meta.num_seqs) if qsl[i + 1] - qsl[i] == 1)
    return meta.derived["decode_rows"]


def decode_layout(
    meta: AttentionMetadata, page_size: int, sliding_window: int | None, rows: tuple[int, ...] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pages one query per sequence reads and its additive key mask, derived once per step and window:
    for every sequence of a decode-only step, or for `rows` (decode_rows) of a mixed one.

    Returns blocks [B, nb] int64 (each sequence's pages from the first one its query may see, padded by
    repeating the table's last column) and bias [B, 1, 1, nb * page_size] float32 (0 where the query
    attends, -inf past the sequence's end and before its window).
    """
    key = ("decode", page_size, sliding_window, rows)
    if key not in meta.derived:
        seq_lens = meta.seq_lens_cpu if rows is None else [meta.seq_lens_cpu[i] for i in rows]
        window = sliding_window
        first = [0 if window is None else max(0, n - window) // page_size for n in seq_lens]
        num_blocks = max(-(-n // page_size) - f for n, f in zip(seq_lens, first))
        width = meta.block_tables.shape[1]
        cols = [[min(f + j, width - 1) for j in range(num_blocks)] for f in first]
        device = meta.block_tables.device
        tables = meta.block_tables if rows is None else meta.block_tables[device_tensor(rows, torch.int64, device)]
        blocks = tables.gather(1, device_tensor(cols, torch.int64, device)).long()
        key_pos = torch.tensor(first)[:, None] * page_size + torch.arange(num_blocks * page_size)  # [B, S]
        lens = torch.tensor(seq_lens)[:, None]
        allowed = key_pos < lens
        if window is not None:
            # HF's convention: the query (position n - 1) sees itself and the window - 1 keys before it
            allowed &= key_pos >= lens - window
        bias = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        meta.derived[key] = (blocks, bias[:, None, None, :].to(device))
    return meta.derived[key]


def decode_attention(
    q: torch.Tensor,  # [B, Nq, D], one query per sequence
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
    blocks: torch.Tensor,  # [B, nb] int64, from decode_layout
    bias: torch.Tensor,  # [B, 1, 1, nb * page_size] float32, from decode_layout
    scale: float,
    sinks: torch.Tensor | None = None,  # [Nq] sink logits
) -> torch.Tensor:  # [B, Nq, D]
    """Attention of a decode-only batch in a handful of ops: one gather of every sequence's pages, then
    batched matmuls in which the query heads sharing a kv head are the rows of one group (GQA without
    repeating K/V). Masked keys get probability exactly 0, so padding never changes a result. Sinks: one more
    score column per head, dropped after the softmax. 16-bit inputs without sinks go to SDPA's CPU flash kernel
    (`_decode_attention_16bit`); 16-bit ones with sinks are computed in float32 and the output rounded once.

    NOTE: the gather is one index_select over the flattened tables (advanced indexing `kv_cache[:, blocks]`, the
    same copy, took ~6x longer on the CPU). Float32 pages keep the strided views whose copies matmul makes, so
    the float32 bits stay those of the first version."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    if q.device.type == "cpu" and q.dtype != torch.float32 and q.dtype == kv_cache.dtype and sinks is None:
        return _decode_attention_16bit(q, kv_cache, blocks, bias, scale)
    kv = kv_cache.index_select(1, blocks.flatten()).view(2, num_seqs, -1, num_kv_heads, head_dim)  # [2, B, S, Nkv, D]
    if kv.dtype == torch.float32:
        keys, values = kv[0].transpose(1, 2), kv[1].transpose(1, 2)  # [B, Nkv, S, D]
    else:
        keys, values = torch.empty(kv.transpose(2, 3).shape, device=kv.device).copy_(kv.transpose(2, 3))
    groups = q.float().reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)  # h -> kv head h // G
    scores = torch.add(bias, torch.matmul(groups, keys.transpose(2, 3)), alpha=scale)  # [B, Nkv, G, S]
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.to(scores.dtype).view(1, num_kv_heads, -1, 1).expand(num_seqs, -1, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs, values).reshape(num_seqs, num_heads, head_dim).to(q.dtype)


# keys per SDPA decode gather are rounded up to a multiple of this (see _decode_attention_16bit)
_FLASH_KEY_MULTIPLE = 16


def _decode_attention_16bit(
    q: torch.Tensor,  # [B, Nq, D] 16-bit
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D], q's dtype
    blocks: torch.Tensor,  # [B, nb] int64
    bias: torch.Tensor,  # [B, 1, 1, nb * page_size] float32
    scale: float,
) -> torch.Tensor:  # [B, Nq, D]
    """decode_attention for 16-bit pages: SDPA's CPU flash kernel reads the gathered pages in place ([B, S, Nkv, D]
    seen as [B, Nkv, S, D]; GQA without repeats) and accumulates in float32; the probabilities meet V rounded to
    q's dtype, and the output is rounded once. No float32 copy of K/V (that copy and its matmuls were ~2/3 of a
    b=8 SmolLM2 decode attention).

    NOTE: batch invariance. The kernel splits the keys into blocks of 512 and, inside a block, vectorizes its exp
    sums and scalings 16 floats at a time with a scalar tail (a tail element gets another exp): a key count that is
    a multiple of 16 keeps every real key in the same lane at any padding, and a block of masked keys adds exact
    zeros (its max is the running one, so the rescale is exp(0) = 1). Each (sequence, head) row is one thread's,
    so the bits do not depend on the thread count. tests/models/test_decode_attention.py checks both."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, page_size = kv_cache.shape[3], kv_cache.shape[2]
    more = 0  # whole pages more, repeating the last column, masked
    while (blocks.shape[1] + more) * page_size % _FLASH_KEY_MULTIPLE:
        more += 1
    if more:
        blocks = torch.cat([blocks, blocks[:, -1:].expand(-1, more)], dim=1)
        bias = F.pad(bias, (0, more * page_size), value=float("-inf"))
    kv = kv_cache.index_select(1, blocks.flatten()).view(2, num_seqs, -1, num_kv_heads, head_dim)  # [2, B, S, Nkv, D]
    o = F.scaled_dot_product_attention(q[:, :, None], kv[0].transpose(1, 2), kv[1].transpose(1, 2), attn_mask=bias,
                                       scale=scale, enable_gqa=num_heads > num_kv_heads)  # [B, Nq, 1, D]
    return o.reshape(num_seqs, num_heads, head_dim)


def _mask(
    first_pos: int, num_queries: int, key_start: int, seq_len: int, sliding_window: int | None, device
) -> torch.Tensor | None:
    """[Lq, S] bool (True = attend), or None when every query sees every gathered key."""
    if num_queries == 1 and (sliding_window is None or seq_len - key_start <= sliding_window):
        return None
    q_pos = torch.arange(first_pos, first_pos + num_queries, device=device)[:, None]
    k_pos = torch.arange(key_start, seq_len, device=device)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        # HF's convention: a query sees itself and the sliding_window - 1 keys before it.
        allowed &= k_pos > q_pos - sliding_window
    return allowed


def _attend(
    q: torch.Tensor,  # [Lq, Nq, D]
    keys: torch.Tensor,  # [S, Nkv, D]
    values: torch.Tensor,  # [S, Nkv, D]
    mask: torch.Tensor | None,  # [Lq, S] bool
    scale: float,
    softcap: float | None,
    sinks: torch.Tensor | None = None,  # [Nq] sink logits
) -> torch.Tensor:  # [Lq, Nq, D]
    num_groups = q.shape[1] // keys.shape[1]
    qh = q.transpose(0, 1)  # [Nq, Lq, D]
    if sinks is not None:
        keys, values, mask = _with_sink_key(keys, values, mask, q.shape[0], sinks, scale)
    if softcap is None:
        # NOTE: SDPA's GQA mode reads each kv head for its query group, no repeated copy of K/V.
        kh = keys.to(q.dtype).transpose(0, 1)  # [Nkv, S, D]
        vh = values.to(q.dtype).transpose(0, 1)
        # NOTE: with a batch dimension (4-d operands) CPU SDPA takes its flash kernel; 3-d ones fall back to the
        # math path (a materialized score matrix): 512-token prefill attention 3.5x slower on this CPU
        o = F.scaled_dot_product_attention(qh[None], kh[None], vh[None], attn_mask=mask, scale=scale,
                                           enable_gqa=num_groups > 1)[0]
    else:
        kh = keys.to(q.dtype).transpose(0, 1).repeat_interleave(num_groups, dim=0)  # [Nq, S, D]
        vh = values.to(q.dtype).transpose(0, 1).repeat_interleave(num_groups, dim=0)
        # SDPA has no logit soft-capping: eager, in HF's order (scale, cap, mask, fp32 softmax).
        scores = torch.matmul(qh, kh.transpose(1, 2)) * scale
        scores = torch.tanh(scores / softcap) * softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
        o = torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), vh)
    return o.transpose(0, 1)


def _with_sink_key(
    keys: torch.Tensor,  # [S, Nkv, D]
    values: torch.Tensor,  # [S, Nkv, D]
    mask: torch.Tensor | None,  # [Lq, S] bool
    num_queries: int,
    sinks: torch.Tensor,  # [Nq]
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # keys, values [S + 1, Nkv, D], mask [Nq, Lq, S + 1]
    """Sinks as one more key (SDPA has no sink argument): a zero key and value, so its score is 0 and it adds
    nothing to the output, and an additive per-head mask (in the keys' dtype, as SDPA wants) that makes its logit
    the head's sink. SDPA adds the mask after scaling and the soft-cap path after capping, so the sink meets
    neither, as in HF's eager attention."""
    num_heads = sinks.shape[0]
    zero = keys.new_zeros(1, *keys.shape[1:])
    allowed = mask if mask is not None else torch.ones(num_queries, keys.shape[0], dtype=torch.bool,
                                                       device=keys.device)
    bias = torch.zeros(num_heads, num_queries, keys.shape[0] + 1, dtype=torch.float32, device=keys.device)
    bias[:, :, :-1].masked_fill_(~allowed, float("-inf"))
    bias[:, :, -1] = sinks.float()[:, None]
    return torch.cat([keys, zero]), torch.cat([values, zero]), bias.to(keys.dtype)


# name -> "module:Class"; imported only when chosen, so an optional backend stays optional.
_BACKENDS = {
    "torch": "helios.layers.attention:TorchAttentionBackend",
    "triton": "helios.kernels.backend:TritonAttentionBackend",
}


def attention_backend_name(name: str | None = None, device: torch.device | str = "cpu") -> str:
    """The backend a model on `device` gets: `name` when given (tests); CUDA defaults to Triton when it is
    importable, everything else to torch SDPA."""
    from helios.kernels._triton import HAS_TRITON

    chosen = name or ("triton" if torch.device(device).type == "cuda" and HAS_TRITON else "torch")
    if chosen not in _BACKENDS:
        raise ValueError(f"unknown attention backend {chosen!r}; known: {sorted(_BACKENDS)}")
    return chosen


def select_attention_backend(
    name: str | None = None, device: torch.device | str = "cpu", switches: Switches = DEFAULT_SWITCHES, **options
) -> AttentionBackend:
    """Pick the backend once per model (attention_backend_name). `options` go to the backend (e.g.
    decode_num_splits); the Triton one also takes the fused_decode switch."""
    chosen = attention_backend_name(name, device)
    if chosen == "triton":
        options.setdefault("fused_decode", switches.fused_decode)
    module, cls = _BACKENDS[chosen].split(":")
    return getattr(importlib.import_module(module), cls)(**options)


class Attention(nn.Module):
    """Fused-qkv attention with optional qkv bias, per-head q/k RMSNorm, rotary and sliding window; optionally an
    output gate (qwen3_5: o *= sigmoid(gate) per head before the o projection) and partial rotary (the leading
    rotary_dim dims of each head rotate, the rest pass). With gate_per_head (step3p7) the gate has one row per head
    (qkv's last Nq rows), its sigmoid scaling every channel of the head.

    Tensors bound: qkv.weight [(Nq + 2*Nkv)*D, H] (+ qkv.bias; with output_gate [(2*Nq + 2*Nkv)*D, H], the gate
    rows last), q_norm/k_norm.weight [D], o.weight [H, Nq*D]. With v_head_dim Dv (mimo_v2_flash) the v rows are
    Nkv*Dv and o.weight [H, Nq*Dv]: V is zero-padded to D for the cache and the backend, the output cut back to Dv.
    With sinks, sinks [Nq]: per-head logits in the softmax denominator (the backend's sinks argument).
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        backend: AttentionBackend,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        norm_multiply_in_float32: bool = False,
        scale: float | None = None,
        sliding_window: int | None = None,
        softcap: float | None = None,
        output_gate: bool = False,
        gate_per_head: bool = False,
        rotary_dim: int | None = None,
        v_head_dim: int | None = None,
        sinks: bool = False,
        switches: Switches = DEFAULT_SWITCHES,
    ):
        super().__init__()
        self.output_gate = output_gate
        self.gate_per_head = output_gate and gate_per_head
        self.v_head_dim = v_head_dim or head_dim
        self.rotary_dim = rotary_dim if rotary_dim is not None and rotary_dim < head_dim else None
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.backend = backend
        self.scale = scale if scale is not None else head_dim**-0.5
        self.sliding_window = sliding_window
        self.softcap = softcap
        self.l2_prefetch = switches.l2_prefetch  # batch-1 GPU decode: the o weight into L2 beside attention
        rows = (num_heads * (2 if output_gate else 1) + num_kv_heads) * head_dim + num_kv_heads * self.v_head_dim
        if self.gate_per_head:  # one gate row per head, not one per channel
            rows -= num_heads * (head_dim - 1)
        self.qkv = Linear(hidden_size, rows, bias=bias, switches=switches)
        # the fused backend's qkv launch knows neither the gate, partial rotary, a narrower V nor sinks: such a
        # layer takes its q, k, v
        self.fuses_qkv = (getattr(backend, "fuses_layers", False) and not output_gate and self.rotary_dim is None
                          and self.v_head_dim == head_dim and not sinks)
        # such a layer on the fused backend still takes its q/k norms and rotary as one Triton launch each
        self.fused_ops = getattr(backend, "fuses_layers", False)
        self.q_norm = RMSNorm(head_dim, norm_eps, norm_multiply_in_float32) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, norm_eps, norm_multiply_in_float32) if qk_norm else None
        self.sinks = meta_parameter(num_heads) if sinks else None
        self.o = Linear(num_heads * self.v_head_dim, hidden_size, switches=switches)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [T, D] (partial rotary: [T, rotary_dim])
        kv_cache: torch.Tensor,  # [2, num_pages, page_size, Nkv, D]
        meta: AttentionMetadata,
        qkv: torch.Tensor | None = None,  # [T, (Nq + 2*Nkv)*D]: the qkv projection of x, already computed
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = self.qkv(x) if qkv is None else qkv
        meta = meta.for_window(self.sliding_window)
        if self.fuses_qkv:  # GPU: norms + rotary + cache write in one launch
            return self.o(self.attend_qkv(qkv, cos_sin, kv_cache, meta))
        cos, sin = cos_sin
        v_size = self.num_kv_heads * self.v_head_dim
        v = qkv[:, q_size + kv_size : q_size + kv_size + v_size].view(num_tokens, self.num_kv_heads, self.v_head_dim)
        if self.v_head_dim < self.head_dim and not getattr(self.backend, "pads_values", False):
            v = F.pad(v, (0, self.head_dim - self.v_head_dim))  # the pages keep head_dim values per head, zero-padded
        if self.q_norm is None and self.rotary_dim is None:
            # q and k are adjacent columns of the fused output: one rotary over both heads' sets
            qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
            q, k = apply_rotary(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        else:
            q = qkv[:, :q_size].reshape(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_size : q_size + kv_size].reshape(num_tokens, self.num_kv_heads, self.head_dim)
            if self.fused_ops and self.q_norm is not None:  # q's and k's norms and rotary in one launch
                qk = qkv[:, : q_size + kv_size].view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
                q, k = norm_rotate_heads(qk, self.num_heads, self.q_norm, self.k_norm, (cos, sin), fused=True)
            elif self.fused_ops:
                q, k = self._rotate_fused(q, k, cos, sin)
            else:
                if self.q_norm is not None:
                    q, k = self.q_norm(q), self.k_norm(k)
                q, k = self._rotate(q, cos, sin), self._rotate(k, cos, sin)
        sinks = {} if self.sinks is None else {"sinks": self.sinks}
        o = self.backend.forward(q, k, v, kv_cache, meta, self.scale, self.sliding_window, self.softcap, **sinks)
        if self.v_head_dim < self.head_dim:
            o = o[..., : self.v_head_dim]
        o = o.reshape(num_tokens, self.num_heads * self.v_head_dim)
        if self.gate_per_head:  # step3p7: the last num_heads rows, one gate per head
            if self.fused_ops:  # one launch for torch's sigmoid and mul (the same roundings)
                from helios.kernels.output_gate import sigmoid_gate

                o = sigmoid_gate(o, qkv[:, -self.num_heads :])
            else:
                gate = torch.sigmoid(qkv[:, -self.num_heads :])
                o = (o.view(num_tokens, self.num_heads, -1) * gate[:, :, None]).view(num_tokens, -1)
        elif self.output_gate:  # qwen3_5: the gate rows follow v's
            gate = qkv[:, q_size + kv_size + v_size :]
            if self.fused_ops:  # one launch for torch's sigmoid and mul (the same roundings)
                from helios.kernels.output_gate import sigmoid_gate

                o = sigmoid_gate(o, gate)
            else:
                o = o * torch.sigmoid(gate)
        return self.o(o)

    def _rotate_fused(self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The rotary of the leading rotary_dim dims of norm-free q and k (helios.kernels.rotary, one launch, in
        place on copies: q and k are views of the projection's output): the fused backend's path for a layer whose
        qkv launch cannot serve it. The rotation is done in float32 and rounded once (the torch path rounds each
        product, as HF does)."""
        from helios.kernels.rotary import rotary_embedding

        q, k = q.contiguous(), k.contiguous()
        rd = self.rotary_dim or self.head_dim
        rotary_embedding(q[..., :rd], k[..., :rd], cos, sin)
        return q, k

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [T, N, D]
        """Rotary over each head's leading rotary_dim dims (all of them without partial rotary)."""
        if self.rotary_dim is None:
            return apply_rotary(x, cos, sin)
        rd = self.rotary_dim
        return torch.cat([apply_rotary(x[..., :rd], cos, sin), x[..., rd:]], dim=-1)

    def attend_qkv(
        self,
        qkv: torch.Tensor,  # [T, (Nq + 2*Nkv)*D], the qkv projection
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        row_norm=None,  # helios.kernels.gemv.RowNorm: qkv projects the un-normed row (see the backend)
    ) -> torch.Tensor:  # [T, Nq*D], before the o projection
        """The fused backend's attention from the qkv projection: q/k norms, rotary, cache write, attention."""
        norms = None
        meta = meta.for_window(self.sliding_window)  # llama's norm-free layers call this directly
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.multiply_in_float32)
        from helios.kernels.prefetch import l2_prefetch

        num_tokens = qkv.shape[0]
        # batch-1 decode: the o weight may stream into L2 beside the latency-bound kernels (opt-in)
        with l2_prefetch(self.o.weight, num_tokens, self.l2_prefetch):
            o = self.backend.forward_qkv(qkv, *cos_sin, self.num_heads, kv_cache, meta, self.scale,
                                         self.sliding_window, self.softcap, norms, row_norm=row_norm)
        return o.reshape(num_tokens, self.num_heads * self.head_dim)
