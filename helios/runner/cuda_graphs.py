"""CUDA graphs of decode steps: static input buffers, one captured graph per decode bucket, replay.

Everything graph-specific lives here (STYLE habit 13): which steps qualify (every request schedules one
token, the batch fits the largest bucket, every block table fits the static width), the padded host-side
inputs, capture (largest bucket first, one shared memory pool, the Triton decode split count pinned per
bucket; lazily: a few buckets at start, the rest one at a time later, a pending bucket's steps running the
same function eagerly) and replay (a window page group's own tables and slots beside the shared ones,
helios/engine/kv_groups.py), including the replay of a speculative next step whose token ids come
straight from the device (runner/decode_overlap.py). Prefill and mixed steps never come here: the runner runs
their prompt rows eagerly, or a few short chunks through runner/prompt_graphs.py.
Sampling and logprob extraction stay outside the graph and read its static float32 logits rows.
Imports torch, helios.layers.attention (metadata) and helios.kernels.aot_shapes (the pinned split rule).
"""

from __future__ import annotations

import gc
import time
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from helios.engine.messages import ScheduledRequest
from helios.kernels._triton import sm_count
from helios.kernels.aot_shapes import SHORT_PROGRAMS, graph_decode_splits, short_decode_splits
from helios.layers.attention import Attention, AttentionMetadata
from helios.runner.input_batch import BatchLayout, int_tensor, max_table_blocks, padded_table, round_up

# rows of the packed int64 input buffer (one host->device copy per step instead of four); a model with a window
# page group has a fifth: the group's KV slots; a hybrid model's last row holds each sequence's state slot
# (StaticBuffers.state_row)
TOKEN_IDS, POSITIONS, SLOT_MAPPING, SEQ_LENS, WINDOW_SLOTS = range(5)
# NOTE: a bucket whose pinned split count is > 1 also gets a graph with fewer splits, replayed while every sequence
# of the step has at most this many keys: choose_num_splits' own rule (no split shorter than 256 keys). With one
# split it skips the merge kernel that an empty-but-for-one-split step would still pay for; with decode_qkv's
# merge inside its launch, a few splits (aot_shapes.short_decode_splits) spread a short step over more programs.
SHORT_SEQ_LEN = 256


def pick_bucket(num_seqs: int, buckets: list[int]) -> int | None:
    """The smallest bucket that holds num_seqs rows, or None when none does."""
    fitting = [b for b in buckets if b >= num_seqs]
    return min(fitting) if fitting else None


def blocks_needed(s: ScheduledRequest, page_size: int) -> int:
    return -(-(s.num_computed_tokens + len(s.token_ids)) // page_size)


def lazy_start_buckets(buckets: list[int]) -> list[int]:
    """The buckets a lazy GraphRunner captures at construction: the smallest (one request decodes on a graph from
    the first step) and the largest.
    NOTE: the largest sizes the shared memory pool: every later, smaller capture fits in the blocks its capture left
    free, where capturing smallest first into an empty pool adds a larger segment with each bucket (the logits rows
    alone grow by 16 x vocab x 2 bytes a bucket)."""
    return sorted({min(buckets), max(buckets)})


class ReplayTimer:
    """GPU time of replayed graphs (/metrics' replay_gpu_ns): a pair of timing events around each replay on the
    stream, read by `poll` once the pair has completed, never waited for; events are reused. Off CUDA (the
    CPU tests' GraphRunner) it records nothing."""

    MAX_PENDING = 1024  # beyond this many unread pairs the oldest is waited for (the runner polls every step)

    def __init__(self, device: torch.device):
        self.enabled = device.type == "cuda"
        self.total_ns = 0
        self.num_samples = 0
        self._pending: deque[tuple[torch.cuda.Event, torch.cuda.Event]] = deque()
        self._free: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextmanager
    def timing(self) -> Iterator[None]:
        if not self.enabled:
            yield
            return
        pair = self._free.pop() if self._free else (torch.cuda.Event(enable_timing=True),
                                                    torch.cuda.Event(enable_timing=True))
        pair[0].record()
        yield
        pair[1].record()
        self._pending.append(pair)
        if len(self._pending) > self.MAX_PENDING:
            self._pending[0][1].synchronize()
            self.poll()

    def poll(self) -> int:
        """Add the completed pairs, oldest first; returns total_ns."""
        while self._pending and self._pending[0][1].query():
            start, end = pair = self._pending.popleft()
            self.total_ns += round(start.elapsed_time(end) * 1e6)  # milliseconds
            self.num_samples += 1
            self._free.append(pair)
        return self.total_ns


@contextmanager
def recording(graph: torch.cuda.CUDAGraph, pool) -> Iterator[None]:
    """torch.cuda.graph(graph, pool) with Python's cyclic garbage collector paused while it records.

    NOTE: a collection inside a capture can free another runner's graphs (an engine dropped but not yet collected,
    as the GPU tests leave one between two tests): their reset is a CUDA call that capture forbids, and it
    invalidates the capture in flight ("operation failed due to a previous error during capture": qwen3_next's
    16-together test on the H200, session 28). The garbage waits for the next collection after the capture; torch
    itself collects before a capture only under torch.compiler.config.force_cudagraph_gc, which costs a full
    collection a bucket."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        with torch.cuda.graph(graph, pool=pool):
            yield
    finally:
        if enabled:
            gc.enable()


@dataclass(frozen=True)
class DecodeInputs:
    """The host-side inputs of one graphed decode step, padded to its bucket.

    Padded rows (num_seqs..bucket) carry token 0, position 0, slot -1 (reshape_and_cache writes nothing)
    and seq_len 0 (decode attention outputs zeros); their logits rows are computed and never read. In a hybrid
    model they update the state cache's scratch row, which only they and sequences without a slot touch.
    """

    bucket: int
    num_seqs: int
    packed: torch.Tensor  # [4..6, bucket] int64: token ids, positions, slot mapping, seq lens (, window slots)
    # (, state slots)
    block_tables: torch.Tensor  # [num_seqs, width] int32, width = the batch's largest needed block count
    max_seq_len: int  # keys of the longest sequence (picks the one-split graph when short)
    window_tables: torch.Tensor | None = None  # [num_seqs, width] int32: the window group's (-1 entries as 0)


def prepare_decode_inputs(scheduled: list[ScheduledRequest], page_size: int, bucket: int,
                          state_scratch: int | None = None) -> DecodeInputs:
    """Pure tensor code on the host; only the blocks a sequence reads are copied (stale entries past them
    in the static table are never read: decode attention stops at seq_len). state_scratch: a hybrid model's
    scratch state row (its sequences' state slots become the last row; padded rows and slotless ones get it).

    NOTE: the tensors are built through input_batch.int_tensor (a seventh of torch.tensor's cost per element): at
    batch 256 the tables are 256 x (context / page size) elements; at batch 1 the host side of a step is on the
    critical path."""
    num_seqs = len(scheduled)
    assert 0 < num_seqs <= bucket, f"{num_seqs} sequences do not fit bucket {bucket}"
    pad = bucket - num_seqs
    positions = [s.num_computed_tokens for s in scheduled]
    needed = [blocks_needed(s, page_size) for s in scheduled]
    packed = [s.token_ids[0] for s in scheduled]
    packed += [0] * pad
    packed += positions
    packed += [0] * pad
    packed += [s.block_ids[p // page_size] * page_size + p % page_size for s, p in zip(scheduled, positions)]
    packed += [-1] * pad
    packed += [p + 1 for p in positions]
    packed += [0] * pad
    num_rows = 4
    is_window = bool(scheduled[0].group_block_ids)
    if is_window:  # the decode writes into the group's newest page, never one it took back
        packed += [s.group_block_ids[0][p // page_size] * page_size + p % page_size
                   for s, p in zip(scheduled, positions)]
        packed += [-1] * pad
        num_rows += 1
    if state_scratch is not None:
        packed += [s.state_slot if s.state_slot >= 0 else state_scratch for s in scheduled]
        packed += [state_scratch] * pad
        num_rows += 1
    packed = int_tensor(packed, torch.int64).view(num_rows, bucket)
    width = max(needed)
    block_tables = padded_table([s.block_ids for s in scheduled], needed, width)
    window_tables = None
    if is_window:  # entries before the window (-1) become page 0: decode attention starts at the window
        window_tables = padded_table([s.group_block_ids[0] for s in scheduled], needed, width).clamp_(min=0)
    return DecodeInputs(bucket, num_seqs, packed, block_tables, max(positions) + 1, window_tables)


class PinnedSlots:
    """Host buffers that per-step inputs are copied to the device from, taken round-robin: pinned on CUDA, so a
    non_blocking copy never waits for the stream (a copy from pageable memory may block the host until the GPU
    reaches it, which would stall the host behind a speculative step). A slot is reused only after the event
    recorded behind the copies made from it (`take`'s block), so no copy reads a slot being refilled."""

    def __init__(self, make, device: torch.device | str, size: int = 4):
        """make(pin) -> one slot's host tensors (a tuple), pinned when `pin`."""
        self.is_cuda = torch.device(device).type == "cuda"
        self.slots = [make(self.is_cuda) for _ in range(size)]
        self.events: list[torch.cuda.Event | None] = [None] * size
        self.next = 0

    @contextmanager
    def take(self) -> Iterator[tuple]:
        """The next slot's tensors, once its previous copies have run; fill them and queue the copies from them
        inside the block: its end records the event the slot's next use waits for."""
        i = self.next
        self.next = (i + 1) % len(self.slots)
        if self.events[i] is not None:
            self.events[i].synchronize()  # its previous copies have run (long ago, in steady state)
        yield self.slots[i]
        if self.is_cuda:
            event = torch.cuda.Event()
            event.record()
            self.events[i] = event


class StagingRing:
    """The graphed decode step's inputs through PinnedSlots: the packed rows and the block tables."""

    def __init__(self, cols: int, max_num_seqs: int, max_blocks: int, device: torch.device, size: int = 4,
                 num_rows: int = 4, num_tables: int = 1):
        self.slots = PinnedSlots(lambda pin: (
            torch.zeros(num_rows, cols, dtype=torch.int64, pin_memory=pin),
            # [num_tables * n * width]: the shared table, then the window group's
            torch.zeros(num_tables * max_num_seqs * max_blocks, dtype=torch.int32, pin_memory=pin),
        ), device, size)

    def copy_to(
        self, inputs: DecodeInputs, packed: torch.Tensor, block_tables: torch.Tensor, table_scratch: torch.Tensor,
        window_tables: torch.Tensor | None = None,
    ) -> None:
        """Copy inputs into packed[:, :bucket] and block_tables[:num_seqs, :width] (and window_tables likewise)
        through the next slot (the tables via table_scratch, a flat device buffer).

        NOTE: the slot's event once went to the index of the last table (this loop's variable shadowed the slot's):
        slot 0 then waited for the latest copy, queued behind a speculative step, and every fourth step lost the
        decode overlap; PinnedSlots.take keeps the slot's index to itself."""
        b, n, w = inputs.bucket, inputs.num_seqs, inputs.block_tables.shape[1]
        tables = [(inputs.block_tables, block_tables)]
        if window_tables is not None:
            tables.append((inputs.window_tables, window_tables))
        with self.slots.take() as (host_packed, host_tables):
            host_packed[:, :b].copy_(inputs.packed)
            for t, (table, _) in enumerate(tables):
                host_tables[t * n * w : (t + 1) * n * w].view(n, w).copy_(table)
            # NOTE: host->device copies of contiguous memory only (a strided one goes through a pageable temporary):
            # all of `packed` (columns past the bucket are stale and never read), the [n, width] tables packed flat,
            # then device-side strided copies into the static tables.
            packed.copy_(host_packed, non_blocking=True)
            size = len(tables) * n * w
            table_scratch[:size].copy_(host_tables[:size], non_blocking=True)
        for t, (_, static) in enumerate(tables):
            static[:n, :w].copy_(table_scratch[t * n * w : (t + 1) * n * w].view(n, w))


class StaticBuffers:
    """Persistent device buffers the graphs read and write; sized for the largest bucket."""

    def __init__(self, max_num_seqs: int, max_blocks: int, vocab_size: int, device: torch.device,
                 window: int | None = None, state_scratch: int | None = None):
        """window: the window of the model's window page group (its tables and slots get buffers too); None: none.
        state_scratch: a hybrid model's scratch state row (the state slots become an input row); None: none."""
        self.max_num_seqs = max_num_seqs
        self.window = window
        self.state_scratch = state_scratch
        num_tables = 2 if window is not None else 1
        num_rows = 3 + num_tables + (state_scratch is not None)
        self.state_row = num_rows - 1 if state_scratch is not None else None
        # NOTE: rows padded to 16 so every row of `packed` starts 16-byte aligned (Triton specializes on it).
        cols = round_up(max_num_seqs, 16)
        self.staging = StagingRing(cols, max_num_seqs, max_blocks, torch.device(device), num_rows=num_rows,
                                   num_tables=num_tables)
        self.num_loads = 0  # bumped by every load: a speculation is valid only while no other load came
        self.packed = torch.zeros(num_rows, cols, dtype=torch.int64, device=device)
        self._fill_padding()
        self.seq_lens = torch.zeros(cols, dtype=torch.int32, device=device)
        # the state slots as the recurrent kernels take them (int32), converted inside the graph like seq_lens
        self.state_slots = (torch.full((cols,), state_scratch, dtype=torch.int32, device=device)
                            if state_scratch is not None else None)
        self.block_tables = torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
        self.window_tables = (torch.zeros(max_num_seqs, max_blocks, dtype=torch.int32, device=device)
                              if window is not None else None)
        self.table_scratch = torch.zeros(num_tables * max_num_seqs * max_blocks, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(cols + 1, dtype=torch.int32, device=device)
        self.logits = torch.zeros(max_num_seqs, vocab_size, dtype=torch.float32, device=device)

    def load(self, inputs: DecodeInputs) -> None:
        """Two host->device copies per step, through the pinned staging ring."""
        self.staging.copy_to(inputs, self.packed, self.block_tables, self.table_scratch, self.window_tables)
        self.num_loads += 1

    def pad_all(self) -> None:
        """Every row a padded row: what capture runs on (no KV write, no KV read). It counts as a load: a capture
        overwrites the logits rows a pending speculative step left (decode_overlap.Speculation.num_loads)."""
        self.packed.zero_()
        self._fill_padding()
        self.num_loads += 1

    def _fill_padding(self) -> None:
        """The padded-row values of the rows whose padding is not 0: no KV slot (-1), the scratch state row."""
        self.packed[SLOT_MAPPING].fill_(-1)
        if self.window is not None:
            self.packed[WINDOW_SLOTS].fill_(-1)
        if self.state_row is not None:
            self.packed[self.state_row].fill_(self.state_scratch)

    def metadata(self, bucket: int, max_model_len: int) -> AttentionMetadata:
        # NOTE: the *_cpu lists are what capture sees; a replay never reads host values. seq_lens_cpu
        # says max_model_len so that even an unpinned backend would size its splits for the longest case.
        return AttentionMetadata(
            positions=self.packed[POSITIONS, :bucket],
            slot_mapping=self.packed[SLOT_MAPPING, :bucket],
            query_start_loc=self.query_start_loc[: bucket + 1],
            seq_lens=self.seq_lens[:bucket],
            block_tables=self.block_tables[:bucket],
            query_start_loc_cpu=list(range(bucket + 1)),
            seq_lens_cpu=[max_model_len] * bucket,
            window_groups=({self.window: (self.window_tables[:bucket], self.packed[WINDOW_SLOTS, :bucket])}
                           if self.window is not None else {}),
            # NOTE: the recurrent layers' graph path reads only the device slots; the host list is capture's
            state_slots=self.state_slots[:bucket] if self.state_slots is not None else None,
            state_slots_cpu=[self.state_scratch] * bucket if self.state_slots is not None else [],
        )


def attention_backends(model: torch.nn.Module) -> list:
    """The distinct attention backend instances of a model (one per model in practice): those of its Attention
    layers and of any attention module of a family's own that declares `attends_through_backend` (its step does
    nothing on the host but hand the backend device tensors, as Attention's does)."""
    seen: dict[int, object] = {}
    for module in model.modules():
        if isinstance(module, Attention) or getattr(module, "attends_through_backend", False):
            seen.setdefault(id(module.backend), module.backend)
    return list(seen.values())


@contextmanager
def pinned_decode_splits(backends: list, num_splits: int) -> Iterator[None]:
    """Pin the Triton decode split count while a graph is captured (a launch constant baked into it);
    a backend constructed with its own pin keeps it."""
    saved = [b.decode_num_splits for b in backends]
    for b in backends:
        if b.decode_num_splits is None:
            b.decode_num_splits = num_splits
    try:
        yield
    finally:
        for b, value in zip(backends, saved):
            b.decode_num_splits = value


def unsupported_reason(model: torch.nn.Module, arch, device: torch.device) -> str | None:
    """Why this model's decode step cannot be captured, or None when it can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if arch.moe is not None:  # graphed only where every MoE block takes its fused path (no host sync)
        from helios.layers.moe import RoutedMoe

        moes = [m for m in model.modules() if isinstance(m, RoutedMoe)]
        unsafe = sorted({type(m).__name__ for m in moes if not m.decode_graph_safe})
        if unsafe or not moes:
            return f"MoE routing syncs with the host (expert loop: {', '.join(unsafe) or 'no fused MoE block'})"
    if arch.recurrent is not None:  # graphed only where every recurrent mixer decodes on its Triton path
        from helios.layers.linear_attention import RecurrentMixer

        mixers = [m for m in model.modules() if isinstance(m, RecurrentMixer)]
        unsafe = sorted({type(m).__name__ for m in mixers if not m.decode_graph_safe})
        if unsafe or not mixers:
            kinds = ", ".join(unsafe) or arch.recurrent.kind
            return f"recurrent layers ({kinds}): their decode step reads host-side slot lists (no Triton path)"
    if getattr(arch, "ple", None) is not None:  # qwen4_exp's PleLayer: its conv and n-gram ids read host lists
        return "PLE layers: their decode step reads host-side state slots and query starts"
    compressed = getattr(arch, "compressed", None)  # deepseek_v4's CSA layers have an indexer too
    if arch.index_dim or (compressed is not None and "csa" in compressed.layer_kinds):
        # graphed only where every layer with an indexer selects and attends on the device
        layers = [m for m in model.modules() if hasattr(m, "indexer")]
        unsafe = sorted({type(m).__name__ for m in layers if not getattr(m, "decode_graph_safe", False)})
        if unsafe or not layers:
            kinds = ", ".join(unsafe) or "none found"
            return f"indexed attention layers ({kinds}): their key selection loops over sequences on the host"
    if arch.mla is not None:  # graphed only where every MLA layer decodes through the Triton kernel
        from helios.layers.mla import MlaAttention

        layers = [m for m in model.modules() if isinstance(m, MlaAttention)]
        if not layers or not all(m.decode_graph_safe for m in layers):
            return "MLA layers decode on the torch path (host-side lengths): graphs need the triton backend"
    names = {b.name for b in attention_backends(model)}
    if names != {"triton"}:
        return f"attention backend {sorted(names)} reads host-side lengths; graphs need the triton backend"
    return None


class GraphRunner:
    """Static buffers plus one CUDA graph per decode bucket; `run` replays the bucket of a decode step.

    lazy=True captures only `lazy_start_buckets` at construction; the others stay `pending`, smallest first, until
    `capture_next` captures them one at a time. A pending bucket's steps run the very function its graph will
    capture, eagerly: the same kernels and pinned splits, so the same logits before and after its capture.
    With capture=False nothing is recorded and `run` calls that function for every bucket (for CPU tests of the
    padding, buffer and pending logic: the Triton interpreter stands in for the device).
    """

    def __init__(
        self,
        model,
        kv_cache,
        *,
        buckets: list[int],
        max_model_len: int,
        page_size: int,
        vocab_size: int,
        num_kv_heads: int,
        device: torch.device,
        capture: bool = True,
        lazy: bool = False,  # capture lazy_start_buckets now, the rest later (capture_next)
        short_seq_len: int = SHORT_SEQ_LEN,  # 0: no short-sequence graphs (benchmarks compare)
        short_programs: int = SHORT_PROGRAMS,  # the short graphs' split rule (aot_shapes.short_decode_splits)
        window: int | None = None,  # the model's window page group (ModelRunner.window): its tables are inputs too
        state_scratch: int | None = None,  # a hybrid model's scratch state row: its state slots are inputs too
        layer_caches: list | None = None,  # what the model's forward takes per layer (None: kv_cache.layer_caches)
    ):
        assert buckets, "no decode buckets"
        self.model = model
        self.kv_cache = kv_cache
        self.layer_caches = layer_caches if layer_caches is not None else kv_cache.layer_caches
        self.buckets = sorted(set(buckets))
        self.max_model_len = max_model_len
        self.page_size = page_size
        self.device = torch.device(device)
        self.max_blocks = max_table_blocks(max_model_len, page_size)
        self.buffers = StaticBuffers(self.buckets[-1], self.max_blocks, vocab_size, self.device, window, state_scratch)
        self.backends = attention_backends(model)
        num_sms = sm_count(self.device)  # 132 off a GPU; on meta the traced GPU's (helios.runner.aot_trace)
        self.num_splits = {b: graph_decode_splits(b, num_kv_heads, max_model_len, num_sms) for b in self.buckets}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # fewer splits (one, or a few where decode merges inside its launch), for steps of short sequences
        self.short_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.short_seq_len = short_seq_len
        head_dim = kv_cache.layers[0].shape[-1]
        # the fused_decode switch, as the model's backends were built with it (a torch backend never fuses: as on)
        fused_decode = all(getattr(b, "fused_decode", True) for b in self.backends)
        self.short_splits = {b: self._short_splits(b, num_kv_heads, head_dim, short_programs, fused_decode)
                             for b in self.buckets}
        self.records_graphs = capture
        self.pool = None  # the one memory pool of every graph, made at the first capture
        # buckets not captured yet, smallest first (capture_next's order); their steps run _forward eagerly
        self.pending: list[int] = [b for b in self.buckets if b not in lazy_start_buckets(self.buckets)] if lazy else []
        self.uncaptured: list[int] = []  # buckets whose capture ran out of memory: eager for good
        self.num_replays = 0  # every replay, speculative ones included
        self.num_eager_runs = 0  # steps of pending buckets, run eagerly
        self.timer = ReplayTimer(self.device)  # the replays' GPU time
        self.capture_s = self.capture([b for b in self.buckets if b not in self.pending])  # at construction

    # --- capture ----------------------------------------------------------------------------------

    @staticmethod
    def _short_splits(bucket: int, num_kv_heads: int, head_dim: int, programs: int, fused_decode: bool) -> int:
        """A few splits when decode attention is decode_qkv's one launch with its merge inside (a split then
        costs no launch: more programs for a latency-bound kernel); otherwise one (no merge kernel)."""
        from helios.kernels import decode_qkv

        # NOTE: head_dim < 32 decodes through paged_attention (backend.forward_qkv), whose splits cost a merge kernel
        if not (decode_qkv.MERGE_IN_KERNEL and fused_decode and head_dim >= 32):
            return 1
        return short_decode_splits(bucket, num_kv_heads, programs)

    def splits_for(self, bucket: int, max_seq_len: int) -> int:
        """The decode split count of the graph that replays a step of this bucket and longest sequence."""
        return self.short_splits[bucket] if max_seq_len <= self.short_seq_len else self.num_splits[bucket]

    def graph_for(self, bucket: int, max_seq_len: int) -> torch.cuda.CUDAGraph:
        if max_seq_len <= self.short_seq_len and bucket in self.short_graphs:
            return self.short_graphs[bucket]
        return self.graphs[bucket]

    def _forward(self, bucket: int, num_splits: int) -> None:
        """The captured computation: static inputs -> static float32 logits rows [bucket, V]."""
        buf = self.buffers
        buf.seq_lens[:bucket].copy_(buf.packed[SEQ_LENS, :bucket])  # int64 -> int32, inside the graph
        if buf.state_row is not None:
            buf.state_slots[:bucket].copy_(buf.packed[buf.state_row, :bucket])
        with pinned_decode_splits(self.backends, num_splits):
            meta = buf.metadata(bucket, self.max_model_len)
            hidden = self.model.forward(buf.packed[TOKEN_IDS, :bucket], meta, self.layer_caches)
            buf.logits[:bucket].copy_(self.model.compute_logits(hidden))

    @property
    def num_graphs(self) -> int:
        return len(self.graphs) + len(self.short_graphs)

    def is_captured(self, bucket: int) -> bool:
        """Whether a step of this bucket replays a graph (with capture=False: would replay one)."""
        return bucket not in self.pending and bucket not in self.uncaptured

    @torch.inference_mode()
    def capture(self, buckets: list[int]) -> float:
        """Capture these buckets, largest first, into the one memory pool; returns the seconds it took.

        NOTE: on the thread that runs the steps, between two of them: a capture's warm-up and recording run on the
        static buffers and the stream that replays use (a pending speculative step is dropped: pad_all counts as
        a load)."""
        t0 = time.perf_counter()
        for bucket in sorted(buckets, reverse=True):
            self.buffers.pad_all()
            if self.records_graphs:
                self._capture_bucket(bucket)
            if bucket in self.pending:
                self.pending.remove(bucket)
        if self.records_graphs:
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0

    def capture_next(self, bucket: int | None = None) -> float:
        """Capture a pending bucket (None: the smallest); returns the seconds it took. A capture that runs out of device memory
        leaves its bucket uncaptured for good (its steps keep running eagerly), with a warning."""
        bucket = self.pending[0] if bucket is None else bucket
        t0 = time.perf_counter()
        try:
            return self.capture([bucket])
        except torch.cuda.OutOfMemoryError as exc:
            self.pending.remove(bucket)
            self.uncaptured.append(bucket)
            self.graphs.pop(bucket, None)
            self.short_graphs.pop(bucket, None)
            warnings.warn(f"CUDA graph of decode bucket {bucket} not captured (its steps stay eager): {exc}",
                          stacklevel=2)
            return time.perf_counter() - t0

    def _capture_bucket(self, bucket: int) -> None:
        """The bucket's graph, and its short-sequence variant where that pins fewer splits."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for splits, graphs in zip(self.graph_splits(bucket), (self.graphs, self.short_graphs)):
            self._forward(bucket, splits)  # warm-up: loads/compiles this bucket's kernels, sets up cuBLAS
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with recording(graph, self.pool):
                self._forward(bucket, splits)
            graphs[bucket] = graph

    def graph_splits(self, bucket: int) -> list[int]:
        """The decode split counts of the bucket's graphs: its own, then its short-sequence variant's where that
        pins fewer (and short graphs are wanted)."""
        splits = [self.num_splits[bucket]]
        if self.short_seq_len > 0 and self.short_splits[bucket] != splits[0]:
            splits.append(self.short_splits[bucket])
        return splits

    @torch.inference_mode()
    def run_variants(self, bucket: int) -> None:
        """Each of the bucket's graphed computations once, eagerly, on padded rows (what its capture records):
        helios.runner.aot_trace runs them on meta tensors to find the kernels a capture launches."""
        for splits in self.graph_splits(bucket):
            self.buffers.pad_all()
            self._forward(bucket, splits)

    # --- replay -----------------------------------------------------------------------------------

    def bucket_for(self, scheduled: list[ScheduledRequest], layout: BatchLayout) -> int | None:
        """The bucket that replays this step, or None when it runs eagerly."""
        if not layout.is_decode_only:
            return None
        bucket = pick_bucket(len(scheduled), self.buckets)
        if bucket is None or max(blocks_needed(s, self.page_size) for s in scheduled) > self.max_blocks:
            return None
        return bucket

    def run(self, scheduled: list[ScheduledRequest], layout: BatchLayout, bucket: int) -> torch.Tensor:
        """[N, V] float32 logits of the layout's logits rows.

        NOTE: the result views the static logits buffer: read it (sample, logprobs) before the next replay.
        """
        inputs = self.prepare(scheduled, bucket)
        self.buffers.load(inputs)
        self._replay(bucket, inputs.max_seq_len)
        return self.logits_rows(layout, len(scheduled))

    def prepare(self, scheduled: list[ScheduledRequest], bucket: int) -> DecodeInputs:
        """The host-side inputs of a step of this bucket (prepare_decode_inputs with this runner's state row)."""
        return prepare_decode_inputs(scheduled, self.page_size, bucket, self.buffers.state_scratch)

    def run_next(self, inputs: DecodeInputs, token_ids: torch.Tensor) -> None:  # token_ids: [num_seqs] int64
        """Replay inputs' bucket with the token ids taken from a device tensor (no host sync): the
        speculative next decode step. Its logits stay in the static buffer for `logits_rows`."""
        self.buffers.load(inputs)
        self.buffers.packed[TOKEN_IDS, : inputs.num_seqs].copy_(token_ids)  # device to device, stream-ordered
        self._replay(inputs.bucket, inputs.max_seq_len)

    def logits_rows(self, layout: BatchLayout, num_seqs: int) -> torch.Tensor:  # [N, V] float32
        """The layout's logits rows of the last replay."""
        rows = self.buffers.logits[:num_seqs]
        if layout.logits_indices == list(range(num_seqs)):
            return rows
        return rows[torch.tensor(layout.logits_indices, dtype=torch.int64, device=rows.device)]

    def _replay(self, bucket: int, max_seq_len: int) -> None:
        if not self.is_captured(bucket):  # the function its graph will capture, eagerly (same logits)
            self._forward(bucket, self.splits_for(bucket, max_seq_len))
            self.num_eager_runs += 1
            return
        with self.timer.timing():
            if bucket in self.graphs:
                self.graph_for(bucket, max_seq_len).replay()
            else:
                self._forward(bucket, self.splits_for(bucket, max_seq_len))
        self.num_replays += 1
