"""Embedding tables kept in host memory behind a device row cache (per-layer embeddings, huge vocabularies).

A HostEmbedding leaves its table where the core mapped it (the mmap: never copied whole) and keeps an LRU of rows in
a device tensor [cache_rows, width], with the row -> slot map on the host and its mirror on the device. Before each
forward the runner hands HostEmbeddings the step's token ids (known on the host); the family's rule turns them into
the rows each table reads (gemma4: the ids; qwen4_exp: hashed n-grams), the missing rows go through pinned memory to
their slots on a side stream, and the step's stream waits for that copy (timed: /metrics' replay_readiness_*). The
model reads through HostRows, swapped in for the table's Embedding before binding: cache[device_map[ids]], with
every tensor static, so a decode graph captures it unchanged. Imports torch and runner.cuda_graphs' timer only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from helios.runner.cuda_graphs import ReplayTimer

MODES = ("auto", "on", "off")
# auto: candidate tables go to the host (largest first) while the weights would take more than this share of the
# device's free memory, which leaves the rest for the KV pool, activations and graphs
AUTO_WEIGHT_SHARE = 0.75
MIN_CACHE_ROWS = 8192  # a cache holds at least this many rows (or the whole table), whatever a step needs

# NOTE: the speculative next decode step (runner/decode_overlap.py) is enqueued before its token ids reach the host,
# so its rows cannot be looked up first. It reads the device map as it stands: a row that is resident reads the
# right values, one that is not reads slot 0 (device_map -1, clamped) and gives wrong logits. Once the ids are read
# (DecodeOverlap.launch returns them) `take_speculative` checks them against the host map, which no lookup changed
# since the launch: all resident -> the step is valid (its rows counted as hits); otherwise the runner drops the
# speculation and the next plan runs that step again after a normal lookup. A dropped step's KV writes are
# harmless (decode_overlap.py says why). Families whose rows need the n-gram context never keep a speculation.


class HostEmbedding:
    """One table [num_rows, width] in host memory and its device row cache; hit, miss, eviction and byte counts."""

    def __init__(self, table: torch.Tensor, cache_rows: int, device: torch.device | str, dtype: torch.dtype):
        self.table = table  # the core's tensor (mmap-backed): rows are read from it, never the whole table
        self.num_rows, self.width = table.shape
        self.cache_rows = min(cache_rows, self.num_rows)
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self.cache = torch.zeros(self.cache_rows, self.width, dtype=dtype, device=self.device)  # [cache_rows, width]
        self.device_map = torch.full((self.num_rows,), -1, dtype=torch.int32, device=self.device)  # row -> slot
        # the host's view: row -> slot (-1: absent), slot -> row (-1: free), slot -> the lookup that last used it
        self.slot_of = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self.row_of = torch.full((self.cache_rows,), -1, dtype=torch.int64)
        self.last_used = torch.full((self.cache_rows,), -1, dtype=torch.int64)
        self.num_lookups = 0
        self.row_bytes = self.width * self.cache.element_size()
        self.num_hits = self.num_misses = self.num_evictions = self.num_bytes = 0
        self.copied: torch.cuda.Event | None = None  # the last copy's completion on the side stream
        if self.is_cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.staging = torch.empty(self.cache_rows, self.width, dtype=dtype, pin_memory=True)
            # chosen (k), then index and value (n = evicted + missing <= 2k each), k <= cache_rows
            self.index_staging = torch.empty(5 * self.cache_rows, dtype=torch.int64, pin_memory=True)

    def is_resident(self, rows: torch.Tensor) -> bool:
        return bool((self.slot_of[rows.flatten()] >= 0).all())

    def prepare(self, rows: torch.Tensor) -> bool:
        """Make `rows` (host int64, any shape) resident; returns whether a copy was enqueued (then the step's stream
        must wait for `copied`). Raises when one step reads more distinct rows than the cache holds."""
        self.num_lookups += 1
        unique = torch.unique(rows.flatten())
        if unique.numel() > self.cache_rows:
            raise RuntimeError(f"a step reads {unique.numel()} rows of a host embedding table; its device cache holds "
                               f"{self.cache_rows} (raise host_embedding_rows or lower the step's token budget)")
        slots = self.slot_of[unique]
        hit = slots >= 0
        self.last_used[slots[hit]] = self.num_lookups
        missing = unique[~hit]
        k = missing.numel()
        self.num_hits += unique.numel() - k
        self.num_misses += k
        if k == 0:
            return False
        # free slots (-1) first, then the least recently used; never one of this step's (at least k are older)
        chosen = torch.topk(self.last_used, k, largest=False).indices
        evicted = self.row_of[chosen]
        evicted = evicted[evicted >= 0]
        self.num_evictions += evicted.numel()
        self.num_bytes += k * self.row_bytes
        self.slot_of[evicted] = -1
        self.slot_of[missing] = chosen
        self.row_of[chosen] = missing
        self.last_used[chosen] = self.num_lookups
        index = torch.cat([evicted, missing])
        value = torch.cat([torch.full_like(evicted, -1), chosen])
        if self.is_cuda:
            self._copy_async(missing, chosen, index, value, evicting=evicted.numel() > 0)
        else:  # the CPU: the "device" cache is a host tensor, the copy done here
            self.cache[chosen] = self.table[missing].to(self.cache.dtype)
            self.device_map[index] = value.to(torch.int32)
        return True

    def _copy_async(self, missing: torch.Tensor, chosen: torch.Tensor, index: torch.Tensor, value: torch.Tensor,
                    evicting: bool) -> None:
        """The rows through pinned staging to their slots, and the map's changes, on the side stream.

        NOTE: an evicted slot may still be read by work already enqueued (the previous step, a speculative one): the
        side stream then waits for the main stream first. Without evictions only free slots and absent rows' map
        entries change, which nothing enqueued reads for a valid result."""
        k, n = missing.numel(), index.numel()
        if self.copied is not None:
            self.copied.synchronize()  # the staging buffers' last copy has read them (long done, in practice)
        self.staging[:k].copy_(self.table[missing])  # the mmap's rows, cast to the cache's dtype
        ints = self.index_staging
        ints[:k], ints[k : k + n], ints[k + n : k + 2 * n] = chosen, index, value
        main = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if evicting:
                self.stream.wait_stream(main)
            rows = self.staging[:k].to(self.device, non_blocking=True)
            ints_dev = ints[: k + 2 * n].to(self.device, non_blocking=True)
            self.cache.index_copy_(0, ints_dev[:k], rows)
            self.device_map.index_put_((ints_dev[k : k + n],), ints_dev[k + n :].to(torch.int32))
            self.copied = torch.cuda.Event()
            self.copied.record(self.stream)


class HostRows(nn.Module):
    """What the model calls in place of a host table's Embedding: rows read from the device cache by slot.

    NOTE: graph-safe (no host value read); a row must be made resident (HostEmbeddings.ready) before the forward is
    enqueued. An absent row (padded graph rows, a speculative step's unknown ids) reads slot 0, never out of bounds."""

    def __init__(self, table: HostEmbedding):
        super().__init__()
        self.table = table  # not a submodule, no parameters: nothing for bind_tensors to bind

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [...] int64 -> [..., width]
        return F.embedding(self.table.device_map[ids].clamp_min(0), self.table.cache)


RowsOf = Callable[[torch.Tensor, torch.Tensor | None, list[int]], dict[str, torch.Tensor]]


class HostEmbeddings:
    """A model's host tables (name -> HostEmbedding), its family's rule for the rows a batch reads, and the
    readiness timing of the steps: replay_readiness_wait_ns (time a step's stream waited for its rows' copies:
    timing events around the wait on CUDA, the inline copy on the CPU) over replay_readiness_samples (every step
    prepared; one whose rows were all resident waits 0)."""

    def __init__(self, tables: dict[str, HostEmbedding], rows_of: RowsOf, device: torch.device | str,
                 needs_context: bool = False):
        """rows_of(token_ids [T] int64, context [B, n-1] or None, query_start_loc) -> {name: rows}, on the host
        (the family's host_table_rows); needs_context: its rows read the n-gram context (qwen4_exp)."""
        self.tables = tables
        self.rows_of = rows_of
        self.device = torch.device(device)
        self.needs_context = needs_context
        self.timer = ReplayTimer(self.device)
        self.num_untimed = 0  # steps ready without a device wait (all rows resident, or the CPU's inline copy)
        self.cpu_wait_ns = 0

    def modules(self) -> dict[str, nn.Module]:
        """{module name: HostRows} for build_model's `replace` (a table's name less its `.weight`)."""
        return {name.removesuffix(".weight"): HostRows(table) for name, table in self.tables.items()}

    def ready(self, token_ids: list[int], query_start_loc: list[int], context: torch.Tensor | None = None) -> None:
        """Before a forward of these tokens is enqueued: their rows resident, the step's stream behind the copies."""
        rows = self.rows_of(torch.tensor(token_ids, dtype=torch.int64), context, query_start_loc)
        t0 = time.perf_counter_ns()
        copied = [table.copied for name, table in self.tables.items() if table.prepare(rows[name])]
        if not self.device.type == "cuda" or not copied:
            self.cpu_wait_ns += time.perf_counter_ns() - t0 if copied else 0
            self.num_untimed += 1
            return
        main = torch.cuda.current_stream(self.device)
        with self.timer.timing():
            for event in copied:
                main.wait_event(event)

    def take_speculative(self, token_ids: list[int]) -> bool:
        """After a speculative decode step's ids are read: whether every row it read was resident (then it counts as
        a ready step of hits); False: the runner drops it (see the NOTE above)."""
        if self.needs_context:
            return False
        rows = self.rows_of(torch.tensor(token_ids, dtype=torch.int64), None, list(range(len(token_ids) + 1)))
        if not all(table.is_resident(rows[name]) for name, table in self.tables.items()):
            return False
        for name, table in self.tables.items():
            table.prepare(rows[name])  # hits only: no copy
        self.num_untimed += 1
        return True

    def counters(self) -> dict[str, int]:
        """RunnerStats' fields: readiness (completed timings only) and the row caches' counts, summed."""
        tables = self.tables.values()
        return dict(
            replay_readiness_wait_ns=self.timer.poll() + self.cpu_wait_ns,
            replay_readiness_samples=self.timer.num_samples + self.num_untimed,
            embedding_row_cache_hits=sum(t.num_hits for t in tables),
            embedding_row_cache_misses=sum(t.num_misses for t in tables),
            embedding_row_cache_evictions=sum(t.num_evictions for t in tables),
            embedding_row_cache_bytes=sum(t.num_bytes for t in tables),
        )


def choose_host_tables(candidates: list[str], tensors: dict[str, torch.Tensor], mode: str, device: torch.device,
                       dtype: torch.dtype) -> list[str]:
    """The candidate tables (the family's host_tables) that stay in host memory. off: none; on: all; auto: on CUDA
    only, the largest first while the weights would take more than AUTO_WEIGHT_SHARE of the free device memory."""
    if mode not in MODES:
        raise ValueError(f"host_embeddings must be one of {MODES}, not {mode!r}")
    if mode == "off" or not candidates:
        return []
    if mode == "on":
        return list(candidates)
    if device.type != "cuda":
        return []
    free, _ = torch.cuda.mem_get_info(device)
    size = {name: tensors[name].numel() * dtype.itemsize for name in candidates}
    weights = sum(t.numel() * dtype.itemsize for t in tensors.values())
    chosen = []
    for name in sorted(candidates, key=lambda n: -size[n]):
        if weights <= AUTO_WEIGHT_SHARE * free:
            break
        chosen.append(name)
        weights -= size[name]
    return chosen


def build_host_embeddings(model_cls, arch, tensors: dict[str, torch.Tensor], names: list[str],
                          device: torch.device | str, dtype: torch.dtype, cache_rows: int = 0,
                          max_tokens: int = 8192, context_width: int = 0) -> HostEmbeddings:
    """HostEmbeddings over tensors[name] for `names`, each cache of cache_rows rows (0: MIN_CACHE_ROWS or twice
    the rows a step of max_tokens tokens reads, whichever is more; never more than the table)."""

    def rows_of(token_ids, context, query_start_loc):
        return model_cls.host_table_rows(arch, token_ids, context, query_start_loc)

    context = torch.zeros(1, context_width, dtype=torch.int64) if context_width else None
    per_token = rows_of(torch.zeros(1, dtype=torch.int64), context, [0, 1])
    tables = {}
    for name in names:
        rows = cache_rows or max(MIN_CACHE_ROWS, 2 * max_tokens * per_token[name].numel())
        tables[name] = HostEmbedding(tensors[name], rows, device, dtype)
    return HostEmbeddings(tables, rows_of, device, needs_context=bool(context_width))
