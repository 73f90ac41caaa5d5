"""/metrics: one Snapshot of engine and HTTP state, as Prometheus text 0.0.4 or as JSON.

`Snapshot` is the JSON object (absent fields decode as zero, so dashboards read older servers); the text
exposition is prometheus_client's, from a collector over one Snapshot (counters end in _total). No torch.
"""

from __future__ import annotations

import math
import time
from collections import deque

import msgspec
from msgspec import Struct
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from helios.engine.messages import Histogram

FIRST_RESPONSE_WINDOW_S = 60.0
FIRST_RESPONSE_CAPACITY = 4096
PROMETHEUS_CONTENT_TYPE = b"text/plain; version=0.0.4; charset=utf-8"


class FirstResponse(Struct, frozen=True, kw_only=True):
    median_seconds: float | None = None
    samples: int = 0
    window_seconds: float = FIRST_RESPONSE_WINDOW_S
    capacity: int = FIRST_RESPONSE_CAPACITY
    truncated: bool = False


class Snapshot(Struct, kw_only=True):
    """The JSON form of /metrics (spec "Health and metrics"); every integer field defaults to zero."""

    prefill_tokens: int = 0
    generated_tokens: int = 0
    decode_weight_bytes: int = 0
    draft_steps: int = 0
    verify_steps: int = 0
    verification_drafts: int = 0
    verification_rounds: int = 0
    accepted_drafts: int = 0
    draft_rounds: int = 0
    active: int = 0
    pending: int = 0
    completed: int = 0
    reasoning_budget_cuts: int = 0
    failed: int = 0
    replay_gpu_ns: int = 0
    graph_captures_pending: int = 0
    kernels_jit: int = 0
    replay_readiness_wait_ns: int = 0
    replay_readiness_samples: int = 0
    embedding_row_cache_hits: int = 0
    embedding_row_cache_misses: int = 0
    embedding_row_cache_evictions: int = 0
    embedding_row_cache_bytes: int = 0
    reused_tokens: int = 0
    cached_pages: int = 0
    free_pages: int = 0
    total_pages: int = 0
    page_tokens: int = 0
    state_slots_in_use: int = 0
    state_slots_total: int = 0
    checkpoint_captures: dict[str, int] = {}
    checkpoint_skips: dict[str, int] = {}
    checkpoint_extra_work_ns: int = 0
    checkpoints_held: int = 0
    checkpoint_anchor_reservations: int = 0
    host_missing_tokens: Histogram | None = None
    host_estimated_transfer_ns: Histogram | None = None
    host_estimated_prefill_ns: Histogram | None = None
    host_hits: int = 0
    host_reused_tokens: int = 0
    host_memory_records: int = 0
    host_disk_records: int = 0
    host_bytes_out: int = 0
    host_bytes_in: int = 0
    host_held: dict[str, int] = {}  # tier -> records taken
    host_dropped: dict[str, dict[str, int]] = {}  # tier -> reason -> records let go
    host_parked_records: int = 0
    host_store_skipped: int = 0
    host_slots_in_use: int = 0
    host_slots_total: int = 0
    host_intake_slots: int = 0
    host_copyout_headroom_deferrals: int = 0
    learned_drafter: bool = False
    first_response: FirstResponse = FirstResponse()
    http_admission_slots: int = 0
    http_admission_in_use: int = 0
    http_requests: int = 0
    uptime_seconds: int = 0
    graph_launches: dict[str, int] = {}  # forward passes by kind: graph, speculative, eager


# field -> (prometheus name, type, help); fields without a metric (draft_steps, learned_drafter) are JSON-only
PROMETHEUS = {
    "prefill_tokens": ("flare_prefill_tokens_total", "counter", "Prompt tokens consumed by completed prefill"),
    "generated_tokens": ("flare_generated_tokens_total", "counter", "Committed generated tokens"),
    "decode_weight_bytes": ("flare_decode_weight_bytes", "gauge", "Weight bytes one decode step reads"),
    "verify_steps": ("flare_speculative_rounds_total", "counter", "Completed speculative or verification graphs"),
    "verification_drafts": ("flare_verification_draft_tokens_total", "counter", "Draft positions allocated"),
    "verification_rounds": ("flare_verification_request_rounds_total", "counter", "Decode/verification rounds"),
    "accepted_drafts": ("flare_accepted_draft_tokens_total", "counter", "Accepted draft tokens"),
    "draft_rounds": ("flare_draft_request_rounds_total", "counter", "Request rounds that offered a draft"),
    "active": ("flare_active_requests", "gauge", "Model slots with a live request"),
    "pending": ("flare_pending_requests", "gauge", "Requests waiting in the model scheduler"),
    "completed": ("flare_requests_completed_total", "counter", "Requests whose generation completed"),
    "reasoning_budget_cuts": ("flare_reasoning_budget_cuts_total", "counter", "Reasoning closed by the budget"),
    "failed": ("flare_requests_failed_total", "counter", "Requests failed by admission, execution or output"),
    "replay_gpu_ns": ("flare_replay_gpu_nanoseconds_total", "counter", "CUDA graph replay time"),
    "kernels_jit": ("flare_kernels_jit_total", "counter",
                    "Triton kernels compiled (or read from Triton's cache) at a launch after start-up"),
    "graph_captures_pending": ("flare_graph_captures_pending", "gauge",
                               "CUDA graph buckets left to capture (start-up work the idle engine finishes)"),
    "replay_readiness_wait_ns": ("flare_replay_readiness_wait_nanoseconds_total", "counter", "Readiness delay"),
    "replay_readiness_samples": ("flare_replay_readiness_samples_total", "counter", "Graphs with readiness timing"),
    "embedding_row_cache_hits": ("flare_embedding_row_cache_hits_total", "counter",
                                 "Host embedding rows a step found in the device row cache"),
    "embedding_row_cache_misses": ("flare_embedding_row_cache_misses_total", "counter",
                                   "Host embedding rows copied host -> device"),
    "embedding_row_cache_evictions": ("flare_embedding_row_cache_evictions_total", "counter",
                                      "Rows the embedding row cache evicted"),
    "embedding_row_cache_bytes": ("flare_embedding_row_cache_bytes_total", "counter",
                                  "Bytes copied host -> device into the embedding row cache"),
    "reused_tokens": ("flare_cache_reused_tokens_total", "counter", "Tokens covered by GPU prefix-cache hits"),
    "cached_pages": ("flare_cached_kv_pages", "gauge", "KV pages owned by immutable checkpoints"),
    "free_pages": ("flare_free_kv_pages", "gauge", "Reusable KV pages"),
    "total_pages": ("flare_total_kv_pages", "gauge", "Pages in the KV pool"),
    "page_tokens": ("flare_kv_page_tokens", "gauge", "Tokens per KV page"),
    "state_slots_in_use": ("flare_state_slots_in_use", "gauge", "Recurrent-state slots held by running requests"),
    "state_slots_total": ("flare_state_slots_total", "gauge", "Recurrent-state slots of a hybrid model"),
    "checkpoint_extra_work_ns": ("flare_checkpoint_extra_work_nanoseconds_total", "counter",
                                 "Predicted extra work charged for state checkpoint captures (not a GPU timing)"),
    "checkpoints_held": ("flare_checkpoints_held", "gauge", "State checkpoints held in GPU state slots"),
    "checkpoint_anchor_reservations": ("flare_checkpoint_anchor_reservations", "gauge",
                                       "Unused anchor guards (state slots set aside for anchors ahead)"),
    "host_hits": ("flare_host_cache_hits_total", "counter", "Host prefix-store lookups that fetched"),
    "host_reused_tokens": ("flare_host_cache_reused_tokens_total", "counter", "Tokens reused from the host store"),
    "host_memory_records": ("flare_host_cache_memory_records", "gauge", "Host store records in memory"),
    "host_disk_records": ("flare_host_cache_disk_records", "gauge", "Host store records on disk"),
    "host_bytes_out": ("flare_host_cache_bytes_out_total", "counter", "Bytes copied GPU -> host store"),
    "host_bytes_in": ("flare_host_cache_bytes_in_total", "counter", "Bytes copied host store -> GPU"),
    "host_parked_records": ("flare_host_cache_parked_records", "gauge", "Complete DRAM copies awaiting disk writes"),
    "host_store_skipped": ("flare_host_cache_store_skipped_total", "counter",
                           "Host store offers not taken (duplicates and retries; not drops)"),
    "host_slots_in_use": ("flare_host_cache_slots_in_use", "gauge", "Host store record slots in use"),
    "host_slots_total": ("flare_host_cache_slots_total", "gauge", "Host store record slots (intake included)"),
    "host_intake_slots": ("flare_host_cache_intake_slots", "gauge", "Host store slots taking automatic intake"),
    "host_copyout_headroom_deferrals": ("flare_host_cache_copyout_headroom_deferrals_total", "counter",
                                        "Copy-out offers deferred by the GPU headroom check"),
    "http_admission_slots": ("flare_http_admission_slots", "gauge", "HTTP admission slots"),
    "http_admission_in_use": ("flare_http_admission_slots_in_use", "gauge", "HTTP admission slots in use"),
    "http_requests": ("flare_http_requests_total", "counter", "HTTP generation requests received"),
    "uptime_seconds": ("flare_uptime_seconds", "gauge", "Seconds since the server started"),
}


class HttpMetrics:
    """Server-side counters and the first-response window (admission -> first offered text)."""

    def __init__(self):
        self.num_requests = 0
        self._first: deque[tuple[float, float]] = deque()  # (monotonic end, seconds)
        self._truncated = False

    def observe_first_response(self, seconds: float) -> None:
        self._first.append((time.monotonic(), seconds))
        if len(self._first) > FIRST_RESPONSE_CAPACITY:
            self._first.popleft()
            self._truncated = True

    def recent(self) -> list[tuple[float, float]]:
        """(seconds ago, seconds) of the samples inside the window, oldest first."""
        now = time.monotonic()
        while self._first and self._first[0][0] < now - FIRST_RESPONSE_WINDOW_S:
            self._first.popleft()
        return [(now - at, s) for at, s in self._first]

    def first_response(self, samples: list[tuple[float, float]] | None = None) -> FirstResponse:
        """The window's median: of this process's samples, or of `samples` ((seconds ago, seconds), several
        frontends' merged)."""
        if samples is None:
            samples = self.recent()
        values = sorted(s for ago, s in samples if ago <= FIRST_RESPONSE_WINDOW_S)
        median = None
        if values:
            mid = len(values) // 2
            median = values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2
        return FirstResponse(median_seconds=median, samples=len(values), truncated=self._truncated)


class _SnapshotCollector:
    """prometheus_client's view of one Snapshot: every PROMETHEUS field, graph launches by kind, first response."""

    def __init__(self, snap: Snapshot):
        self.snap = snap

    def collect(self):
        snap = self.snap
        for field, (name, kind, help_text) in PROMETHEUS.items():
            value = int(getattr(snap, field))
            if kind == "counter":
                yield CounterMetricFamily(name.removesuffix("_total"), help_text, value=value)
            else:
                yield GaugeMetricFamily(name, help_text, value=value)
        captures = CounterMetricFamily("flare_checkpoint_captures", "State checkpoints captured, by role",
                                       labels=["role"])
        for role in ("anchor", "message", "endpoint"):
            captures.add_metric([role], snap.checkpoint_captures.get(role, 0))
        yield captures
        skips = CounterMetricFamily("flare_checkpoint_skips", "State checkpoint candidates not captured, by reason",
                                    labels=["reason"])
        for reason in ("unknown_cost", "work_budget", "storage"):
            skips.add_metric([reason], snap.checkpoint_skips.get(reason, 0))
        yield skips
        held = CounterMetricFamily("flare_host_cache_held", "Records the host store's tiers took", labels=["tier"])
        dropped = CounterMetricFamily("flare_host_cache_dropped", "Records the host store's tiers let go",
                                      labels=["tier", "reason"])
        for tier in ("dram", "nvme"):
            held.add_metric([tier], snap.host_held.get(tier, 0))
            for reason in ("end_of_chain", "oversize", "io_error"):
                dropped.add_metric([tier, reason], snap.host_dropped.get(tier, {}).get(reason, 0))
        yield held
        yield dropped
        for field, name, help_text in _HISTOGRAMS:
            h = getattr(snap, field)
            if h is not None:
                yield _histogram_family(name, help_text, h)
        launches = CounterMetricFamily("flare_graph_launches", "Model forward passes by kind", labels=["kind"])
        for kind, count in sorted(snap.graph_launches.items()):
            launches.add_metric([kind], count)
        yield launches
        fr = snap.first_response
        yield GaugeMetricFamily("flare_first_response_median_seconds",
                                "Median admission-to-first-text time (60 s window)",
                                value=fr.median_seconds if fr.median_seconds is not None else math.nan)
        yield GaugeMetricFamily("flare_history_drafts_enabled", "Shared decoded history augments learned proposals",
                                value=0)
        yield from vllm_aliases(snap)


def kv_cache_usage(snap: Snapshot) -> float:
    """Used KV pages over the pool (0..1): free pages include evictable prefix-cache pages, as vLLM counts them."""
    return (snap.total_pages - snap.free_pages) / snap.total_pages if snap.total_pages else 0.0


def vllm_aliases(snap: Snapshot):
    """The gauges a Gateway API Inference Extension / llm-d endpoint picker scrapes by default, under vLLM's names
    (its flags total-queued-requests-, total-running-requests-, kv-cache-usage-percentage-, lora-info- and
    cache-info-metric), computed from the flare_ values above. vllm:gpu_cache_usage_perc is the older EPPs'
    default name for the same fraction. No LoRA: lora_requests_info says no adapter runs or waits (max_lora 0),
    so an EPP's LoRA affinity finds nothing rather than a missing metric."""
    yield GaugeMetricFamily("vllm:num_requests_running", "Alias of flare_active_requests", value=snap.active)
    yield GaugeMetricFamily("vllm:num_requests_waiting", "Alias of flare_pending_requests", value=snap.pending)
    usage = kv_cache_usage(snap)
    yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "Used KV pages over total pages (0..1)", value=usage)
    yield GaugeMetricFamily("vllm:gpu_cache_usage_perc", "Alias of vllm:kv_cache_usage_perc", value=usage)
    cache = GaugeMetricFamily("vllm:cache_config_info", "KV pool shape: tokens per page, pages",
                              labels=["block_size", "num_gpu_blocks"])
    cache.add_metric([str(snap.page_tokens), str(snap.total_pages)], 1)
    yield cache
    lora = GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters (none: helios serves no adapters)",
                             labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
    lora.add_metric(["0", "", ""], time.time())
    yield lora


_HISTOGRAMS = (
    ("host_missing_tokens", "flare_host_cache_missing_tokens", "Tokens a host prefix-store lookup left to compute"),
    ("host_estimated_transfer_ns", "flare_host_cache_estimated_transfer_ns",
     "Predicted copy-in time of the host records a lookup took"),
    ("host_estimated_prefill_ns", "flare_host_cache_estimated_prefill_ns",
     "Predicted prefill time of the tokens a lookup left (measured prefill rate)"),
)


def _histogram_family(name: str, help_text: str, h: Histogram) -> HistogramMetricFamily:
    buckets, total = [], 0
    for bound, count in zip([*h.bounds, math.inf], h.counts):
        total += count
        buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), total))
    return HistogramMetricFamily(name, help_text, buckets=buckets, sum_value=h.sum)


def render_prometheus(snap: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry)


def render_json(snap: Snapshot) -> bytes:
    return msgspec.json.encode(snap)


def _parse_accept(header: str) -> list[tuple[str, float]]:
    ranges = []
    for part in header.split(","):
        bits = [b.strip() for b in part.split(";")]
        if not bits[0]:
            continue
        q = 1.0
        for b in bits[1:]:
            if b.startswith("q="):
                try:
                    q = float(b[2:])
                except ValueError:
                    q = 0.0
        ranges.append((bits[0].lower(), q))
    return ranges


def _quality(ranges: list[tuple[str, float]], media: str) -> tuple[float, int]:
    """(q, index) of the most specific range matching `media`; (0, inf-ish) when none does."""
    kind = media.split("/")[0]
    best = None
    for pattern in (media, f"{kind}/*", "*/*"):
        for i, (m, q) in enumerate(ranges):
            if m == pattern:
                best = best or (q, i)
        if best is not None:
            return best
    return 0.0, 1 << 30


def wants_json(query: dict[str, str], accept: str | None) -> bool:
    """format=json|prometheus wins; else Accept quality (ties: the earlier range); default text.

    Raises ValueError for another format value."""
    fmt = query.get("format")
    if fmt is not None:
        if fmt not in ("json", "prometheus"):
            raise ValueError(fmt)
        return fmt == "json"
    if not accept:
        return False
    ranges = _parse_accept(accept)
    qj, ij = _quality(ranges, "application/json")
    qt, it = _quality(ranges, "text/plain")
    if qj <= 0:
        return False
    return qj > qt or (qj == qt and ij < it)

