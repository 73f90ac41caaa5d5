"""Per-request runner state and the flattened token batch of one step.

`layout_batch` lays the plan's scheduled requests (prefill chunks and decodes alike) out as one token batch
in plain Python (token ids, sequence lengths, which hidden rows need logits); `prepare_batch` turns that into
tensors: positions, KV slots and the attention metadata. The CUDA-graph path (runner/cuda_graphs.py) reuses
the layout and fills its static buffers instead.
Logits are computed only where they are used: the sampling position of a request, or every chunk
position of a request that wants prompt logprobs.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import torch

from helios.engine.messages import SamplingParams, ScheduledRequest
from helios.layers.attention import AttentionMetadata


@dataclass
class RequestState:
    """What the runner remembers about a live request between steps."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    # helios.runner.sampler.SamplerState: also the one record of the request's output tokens
    sampler_state: Any = None

    @property
    def wants_logprobs(self) -> bool:
        return self.sampling.logprobs is not None or self.sampling.logprob_token_ids is not None

    def tokens_before(self, position: int, count: int, pad_id: int) -> list[int]:
        """The `count` tokens before `position` (prompt, then outputs), oldest first, pad_id before position 0."""
        prompt, start = self.prompt_token_ids, max(0, position - count)
        window = prompt[start:position]
        if position > len(prompt):  # slices only: no copy of a long prompt per step
            outputs = self.sampler_state.output_token_ids
            window = window + outputs[max(0, start - len(prompt)) : position - len(prompt)]
        return [pad_id] * (count - len(window)) + window


class RequestRows(msgspec.Struct, frozen=True):
    """Where one scheduled request's outputs live in the step's logits tensor.
    NOTE: a Struct, not a frozen dataclass: one per request per step, and a frozen dataclass's __init__ costs
    ~0.6 us (5 x object.__setattr__), a sixth of a b=256 layout."""

    req_id: str
    logits_start: int  # first logits row of this request
    num_logits: int  # rows: 0, 1 (sample only) or the chunk length (prompt logprobs)
    sample_row: int | None  # logits row of the sampling position, None when the chunk does not sample
    # prompt logprobs: the record of token p+1 for chunk positions p with p+1 inside the prompt;
    # these are the first len(prompt_next_token_ids) rows from logits_start
    prompt_next_token_ids: list[int]


@dataclass(frozen=True)
class PreparedBatch:
    token_ids: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64, hidden rows that get logits
    rows: list[RequestRows]  # one per scheduled request, in plan order


# NOTE: block tables are padded to a multiple of this width, so their row stride (a Triton kernel argument,
# specialized on divisibility by 16) is the same in every step: one compiled variant, eager or graphed.
BLOCK_TABLE_ALIGN = 16


def padded_table(tables: list[list[int]], lengths: list[int], width: int) -> torch.Tensor:  # [n, width] int32
    """Row i: the first lengths[i] entries of tables[i], zeros after (a step's block tables on the host).

    NOTE: each row packed by struct into one zeroed bytearray (torch.frombuffer shares it): torch.tensor of
    Python lists costs ~50 ns an element, struct ~7, and the padding is never converted; at batch 256 a step's
    table is 256 x (context / page size) entries (torch.tensor of padded rows: 3.7 ms a step at 2k-token
    contexts, this 0.5)."""
    buf = bytearray(4 * len(tables) * width)
    for i, (table, n) in enumerate(zip(tables, lengths)):
        struct.pack_into(f"{n}i", buf, 4 * i * width, *(table if len(table) == n else table[:n]))
    return torch.frombuffer(buf, dtype=torch.int32).view(len(tables), width)


def int_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:  # [len(values)] int32 or int64
    """torch.tensor(values, dtype=dtype) at a fraction of its cost (see padded_table)."""
    code = _STRUCT_CODES[dtype]
    buf = bytearray(struct.calcsize(code) * len(values))
    struct.pack_into(f"{len(values)}{code}", buf, 0, *values)
    return torch.frombuffer(buf, dtype=dtype) if values else torch.empty(0, dtype=dtype)


_STRUCT_CODES = {torch.int32: "i", torch.int64: "q"}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def max_table_blocks(max_model_len: int, page_size: int) -> int:
    """Pages a padded block table row holds for a max_model_len context (the graphs' static width): every
    position a step can address lies below max_table_blocks * page_size."""
    return round_up(-(-max_model_len // page_size), BLOCK_TABLE_ALIGN)


@dataclass(frozen=True)
class BatchLayout:
    """The host-side (plain Python) layout of one step's flattened token batch."""

    token_ids: list[int]  # [T]
    query_start_loc: list[int]  # [B + 1]
    seq_lens: list[int]  # [B]
    logits_indices: list[int]  # [N] hidden rows that get logits
    rows: list[RequestRows]  # one per scheduled request, in plan order

    @property
    def is_decode_only(self) -> bool:
        """Every request schedules exactly one token (decodes, and one-token prompts)."""
        return len(self.token_ids) == len(self.seq_lens)


def layout_batch(
    scheduled: list[ScheduledRequest],
    requests: dict[str, RequestState],
    page_size: int,
) -> BatchLayout:
    token_ids: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    rows: list[RequestRows] = []
    first_row = 0  # query_start_loc[-1]
    for s in scheduled:
        num_tokens = len(s.token_ids)
        if num_tokens == 0:
            raise ValueError(f"request {s.req_id}: scheduled with no tokens")
        token_ids += s.token_ids
        end_row = first_row + num_tokens
        query_start_loc.append(end_row)
        seq_len = s.num_computed_tokens + num_tokens
        if (seq_len + page_size - 1) // page_size > len(s.block_ids):
            raise ValueError(f"request {s.req_id}: {seq_len} tokens do not fit in {len(s.block_ids)} blocks")
        seq_lens.append(seq_len)
        logits_start = len(logits_indices)
        next_ids: list[int] = []
        if s.want_prompt_logprobs:
            prompt = requests[s.req_id].prompt_token_ids
            next_ids = prompt[s.num_computed_tokens + 1 : seq_len + 1]
            logits_indices.extend(range(first_row, end_row))
            rows.append(RequestRows(s.req_id, logits_start, num_tokens,
                                    logits_start + num_tokens - 1 if s.sample else None, next_ids))
        elif s.sample:
            logits_indices.append(end_row - 1)
            rows.append(RequestRows(s.req_id, logits_start, 1, logits_start, next_ids))
        else:
            rows.append(RequestRows(s.req_id, logits_start, 0, None, next_ids))
        first_row = end_row
    return BatchLayout(token_ids, query_start_loc, seq_lens, logits_indices, rows)


def prepare_batch(
    scheduled: list[ScheduledRequest],
    requests: dict[str, RequestState],
    page_size: int,
    device: torch.device | str = "cpu",
    layout: BatchLayout | None = None,
    scratch_slot: int | None = None,
    context: tuple[int, int] | None = None,
    window: int | None = None,
) -> PreparedBatch:
    """scratch_slot: a hybrid model's state row for sequences the engine gave none (forward_logits); None when
    the model keeps no state. context: an n-gram model's (count, pad id) of context tokens per sequence
    (qwen4_exp's PLE), None for any other model. window: the window of the page group whose tables arrive in
    group_block_ids (ModelRunner.window), None for a model of one group.
    On CUDA every tensor is made on the host and moved in one asynchronous copy per dtype (upload)."""
    layout = layout or layout_batch(scheduled, requests, page_size)
    if torch.device(device).type == "cuda":
        return _to_device(prepare_batch(scheduled, requests, page_size, "cpu", layout, scratch_slot, context, window),
                          device)
    token_ids, query_start_loc, seq_lens = layout.token_ids, layout.query_start_loc, layout.seq_lens

    max_blocks = round_up(max(len(s.block_ids) for s in scheduled), BLOCK_TABLE_ALIGN)
    block_tables = padded_table([s.block_ids for s in scheduled], [len(s.block_ids) for s in scheduled], max_blocks)
    row_starts = torch.tensor(query_start_loc)  # [S + 1]
    rows = torch.arange(len(token_ids))
    # NOTE: a search of the sequences' ends, not repeat_interleave by counts: that one opened a parallel region per
    # call (~0.1 ms at 2 threads, on the step loop's host path of every eager or prompt-graph step)
    seq_index = torch.searchsorted(row_starts[1:], rows, right=True)  # [T] owning sequence
    starts = torch.tensor([s.num_computed_tokens for s in scheduled])
    positions = starts[seq_index] + rows - row_starts[seq_index]  # [T]
    blocks = block_tables[seq_index, positions // page_size].long()
    slot_mapping = blocks * page_size + positions % page_size  # [T]

    meta = AttentionMetadata(
        positions=positions.to(device),
        slot_mapping=slot_mapping.to(device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
        **_state_slots(scheduled, device, scratch_slot),
        **_context_tokens(scheduled, requests, device, context),
        **_window_groups(scheduled, seq_index, positions, page_size, max_blocks, device, window),
    )
    return PreparedBatch(
        token_ids=torch.tensor(token_ids, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=torch.tensor(layout.logits_indices, dtype=torch.int64, device=device),
        rows=layout.rows,
    )


_META_TENSORS = ("positions", "slot_mapping", "query_start_loc", "seq_lens", "block_tables", "state_slots",
                 "context_token_ids")


def _to_device(batch: PreparedBatch, device) -> PreparedBatch:
    """A batch prepared on the host, its tensors moved to `device` by upload."""
    meta = batch.meta
    names = [name for name in _META_TENSORS if getattr(meta, name) is not None]
    groups = list(meta.window_groups.items())
    tensors = [getattr(meta, name) for name in names] + [t for _, pair in groups for t in pair]
    moved = upload(tensors + [batch.token_ids, batch.logits_indices], device)
    at = len(names)
    window_groups = {w: (moved[at + 2 * i], moved[at + 2 * i + 1]) for i, (w, _) in enumerate(groups)}
    meta = replace(meta, **dict(zip(names, moved)), window_groups=window_groups, derived={})
    return replace(batch, token_ids=moved[-2], meta=meta, logits_indices=moved[-1])


def upload(tensors: list[torch.Tensor], device) -> list[torch.Tensor]:
    """Host tensors on a CUDA device: one pinned staging buffer and one asynchronous copy per dtype (stage), each
    tensor a view of its dtype's device buffer (same shape and values, 16-byte aligned).

    NOTE: a copy from pageable memory (torch.tensor(list, device=...), .to(device)) synchronizes the stream: an
    eager forward whose inputs were made so waited for every kernel queued before it (in a mixed step the decode
    rows' speculative replay, a whole decode step), and the GPU then waited for the host to launch the forward.
    From pinned memory with non_blocking the copies queue behind that work and the host goes on launching; the
    caching host allocator holds each staging buffer until its copy has run."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for staged, places in stage(tensors, pin=True):
        moved = staged.to(device, non_blocking=True)
        for i, offset in places:
            out[i] = moved[offset : offset + tensors[i].numel()].view(tensors[i].shape)
    return out


def stage(tensors: list[torch.Tensor], pin: bool) -> list[tuple[torch.Tensor, list[tuple[int, int]]]]:
    """The tensors packed per dtype: (buffer, [(tensor index, element offset)]), in first-seen dtype order; every
    offset a multiple of 16 bytes, so a view at it keeps the alignment Triton specializes pointer arguments on (a
    misaligned one would launch another compiled variant than the precompiled kernels)."""
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        by_dtype.setdefault(t.dtype, []).append(i)
    packed = []
    for dtype, members in by_dtype.items():
        align = max(1, 16 // dtype.itemsize)
        places, total = [], 0
        for i in members:
            places.append((i, total))
            total += round_up(tensors[i].numel(), align)
        staged = torch.empty(total, dtype=dtype, pin_memory=pin)
        for i, offset in places:
            staged[offset : offset + tensors[i].numel()].copy_(tensors[i].reshape(-1))
        packed.append((staged, places))
    return packed


def _state_slots(scheduled: list[ScheduledRequest], device, scratch_slot: int | None) -> dict:
    """AttentionMetadata's state slot fields (empty for a model without recurrent layers)."""
    if scratch_slot is None:
        return {}
    slots = [s.state_slot if s.state_slot >= 0 else scratch_slot for s in scheduled]
    if slots.count(scratch_slot) > 1:  # NOTE: they would read and write one state row: wrong tokens, no error
        raise ValueError("several requests of one step have no recurrent state slot (the scheduler assigns one to "
                         "each request of a hybrid model: SchedulerConfig.num_state_slots)")
    return {"state_slots": torch.tensor(slots, dtype=torch.int32, device=device), "state_slots_cpu": slots}


def _context_tokens(scheduled: list[ScheduledRequest], requests: dict[str, RequestState], device,
                    context: tuple[int, int] | None) -> dict:
    """AttentionMetadata's n-gram context (empty unless the model asks for `context` = (count, pad id))."""
    if context is None:
        return {}
    count, pad_id = context
    rows = [requests[s.req_id].tokens_before(s.num_computed_tokens, count, pad_id) for s in scheduled]
    return {"context_token_ids": torch.tensor(rows, dtype=torch.int64, device=device).view(len(rows), count)}


def _window_groups(scheduled: list[ScheduledRequest], seq_index: torch.Tensor, positions: torch.Tensor, page_size: int,
                   max_blocks: int, device, window: int | None) -> dict:
    """AttentionMetadata's window group tables and KV slots (empty for a model of one group). A page the engine took
    back before the window (-1) becomes page 0: no query reads it (every backend starts at the window)."""
    if window is None:
        return {}
    for s in scheduled:
        table = s.group_block_ids[0]
        if len(table) != len(s.block_ids) or table[s.num_computed_tokens // page_size] < 0:
            raise ValueError(f"request {s.req_id}: window table {table} does not hold its chunk")
    tables = padded_table([s.group_block_ids[0] for s in scheduled], [len(s.block_ids) for s in scheduled],
                          max_blocks).clamp_(min=0)
    slots = tables[seq_index, positions // page_size].long() * page_size + positions % page_size  # [T]
    return {"window_groups": {window: (tables.to(device), slots.to(device))}}
