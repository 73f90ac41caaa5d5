"""EngineCore: one scheduler plus one runner; `step()` is schedule -> execute -> update, plus metrics.

Owns the step loop body, runner-failure handling and the counters behind /metrics. Single-threaded: one thread
owns it (AsyncEngine's engine thread, or a test's caller), so adds and aborts only happen between steps.
Pure Python: must not import torch or numpy (the runner is any object with `execute`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
from msgspec import Struct

from helios.engine.config import SchedulerConfig
from helios.engine.constraint import ConstraintOwner
from helios.engine.host_cache import DROP_REASONS, TIERS, HostCache
from helios.engine.kv_events import KVCacheEvent, KVEventLog
from helios.engine.messages import (
    EngineOutput,
    EngineRequest,
    Histogram,
    ModelRunnerOutput,
    RunnerStats,
    SchedulerOutput,
)
from helios.engine.scheduler import QueueFull, Scheduler


class Runner(Protocol):
    """Executes plans; a runner may also offer `stats() -> RunnerStats` (its counters for /metrics)."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


class KVEventPublisher(Protocol):
    """Takes one step's KV cache events (helios/engine/kv_events.py ZmqEventPublisher); must not block."""

    def publish(self, events: list[KVCacheEvent]) -> None: ...


class RequestExecutionError(Exception):
    """Raised by a runner when only some requests are at fault: those fail, the engine stays healthy,
    and the plan's other requests are recomputed from scratch (the runner gets them as new again)."""

    def __init__(self, req_ids: list[str] | set[str], message: str) -> None:
        super().__init__(message)
        self.req_ids = set(req_ids)


class EngineMetrics(Struct, frozen=True, kw_only=True):
    """The engine's share of /metrics (spec field names; totals count from start, the rest are gauges)."""

    prefill_tokens: int  # prompt tokens of completed prefills, excluding prefix reuse
    generated_tokens: int  # committed generated tokens, including EOS and stop tokens
    completed: int  # requests finished with "stop" or "length"
    failed: int  # requests rejected at admission or failed in execution
    active: int  # model slots with a live request
    pending: int  # requests waiting in the scheduler (including preempted ones)
    free_pages: int
    total_pages: int
    page_tokens: int
    state_slots_in_use: int = 0  # recurrent-state slots held (hybrid models; 0 and 0 otherwise)
    state_slots_total: int = 0
    # state checkpoints of a hybrid model (helios/engine/state_checkpoints.py): captures by role, skips by reason
    checkpoint_captures: dict[str, int] = {}
    checkpoint_skips: dict[str, int] = {}
    checkpoint_extra_work_ns: int = 0
    checkpoints_held: int = 0
    checkpoint_anchor_reservations: int = 0  # anchor guards not used yet (slots set aside for anchors ahead)
    # host prefix-store lookups (spec /metrics histograms): missing tokens, predicted transfer and prefill ns
    host_missing_tokens: Histogram | None = None
    host_estimated_transfer_ns: Histogram | None = None
    host_estimated_prefill_ns: Histogram | None = None
    reused_tokens: int = 0  # tokens covered by prefix-cache hits (every admission, re-admissions too)
    cached_pages: int = 0  # pages holding a prefix-cache hash, in use or free (evictable)
    preemptions: int = 0
    reasoning_budget_cuts: int = 0  # requests whose reasoning was closed by their thinking-token budget
    verify_steps: int = 0  # forward passes that advanced at least one decode round (no speculation: no drafts)
    verification_rounds: int = 0  # decode request rounds that committed a token (zero-draft rounds)
    # the host DRAM tier of the prefix cache (zero when off)
    host_hits: int = 0  # admissions that copied at least one host record in
    host_reused_tokens: int = 0  # tokens those records covered (part of reused_tokens)
    host_memory_records: int = 0  # records held now
    host_bytes_out: int = 0  # bytes copied from evicted GPU pages to host records
    host_bytes_in: int = 0  # bytes copied from host records into GPU pages
    host_disk_records: int = 0  # records of the disk tier behind it (files in its record directory)
    # host retention, page and state records together (helios/engine/host_cache.py): records each tier took
    # (dram, nvme), records each let go by reason, DRAM records waiting for their disk write, offers turned down
    host_held: dict[str, int] = {}
    host_dropped: dict[str, dict[str, int]] = {}
    host_parked_records: int = 0
    host_store_skipped: int = 0
    # the DRAM record slots: held, all of them, and those taking automatic intake (every one: each GPU eviction
    # is offered to the tier)
    host_slots_in_use: int = 0
    host_slots_total: int = 0
    host_intake_slots: int = 0
    # NOTE: always 0 here: a copy-out is made in the plan whose allocation evicts the page or checkpoint, before
    # that plan reuses it, never offered ahead of time, so no GPU headroom check ever defers one
    host_copyout_headroom_deferrals: int = 0
    # the runner's counters (RunnerStats): forward passes by kind, GPU time of graph replays
    graph_launches: dict[str, int] = {}
    replay_gpu_ns: int = 0
    graph_captures_pending: int = 0
    kernels_jit: int = 0
    # host embedding tables' readiness and row caches (RunnerStats; zero without them)
    replay_readiness_wait_ns: int = 0
    replay_readiness_samples: int = 0
    embedding_row_cache_hits: int = 0
    embedding_row_cache_misses: int = 0
    embedding_row_cache_evictions: int = 0
    embedding_row_cache_bytes: int = 0


class EngineCore:
    def __init__(self, config: SchedulerConfig, runner: Runner, disk_records: Sequence[bytes] = (), *,
                 state_disk_records: Sequence[bytes] = (),
                 constraints: ConstraintOwner | None = None, kv_events: KVEventPublisher | None = None) -> None:
        """disk_records: the hashes of the host tier's record files found at start-up, least recently used first;
        state_disk_records: likewise, the state records' (hybrid models' checkpoints); constraints: structured
        output's grammar owner (helios/engine/constraint.py); kv_events: where each step's prefix-cache changes
        go for a router (nothing without the prefix cache)."""
        self.config = config
        self.runner = runner
        self.scheduler = Scheduler(config, constraints)
        if self.scheduler.host_cache is not None:
            self.scheduler.host_cache.seed_disk(disk_records)
        if self.scheduler.state_host is not None:
            self.scheduler.state_host.seed_disk(state_disk_records)
        self.error: str | None = None  # set by a runner failure that is not request-specific
        self.kv_events = kv_events if self.scheduler.prefix_cache is not None else None
        self._kv_log: KVEventLog | None = None
        if self.kv_events is not None:
            self._kv_log = KVEventLog(config.page_size)
            self._kv_log.cleared()  # a restarted replica's pages are gone: a router forgets them
            self.scheduler.prefix_cache.attach_events(self._kv_log)
        self._num_generated_tokens = 0
        self._num_completed = 0
        self._num_failed = 0

    @property
    def is_healthy(self) -> bool:
        return self.error is None

    def add_request(self, request: EngineRequest) -> None:
        """Raises QueueFull (queue bound) or ValueError (cannot run); both count as failed."""
        try:
            self.scheduler.add_request(request)
        except (QueueFull, ValueError):
            self._num_failed += 1
            raise

    def abort(self, req_id: str) -> EngineOutput | None:
        """Cancel at any state and free its pages now; returns the terminal record, None if unknown."""
        return self.scheduler.abort(req_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    @property
    def has_background_work(self) -> bool:
        """The runner has deferred start-up work (decode graphs left to capture: runner.capture_pending)."""
        return self.error is None and bool(getattr(self.runner, "has_pending_captures", False))

    def background_step(self) -> None:
        """One unit of the runner's deferred work, between steps on the engine thread; a failure is a runner
        failure (the engine turns unhealthy)."""
        try:
            self.runner.capture_pending()
        except Exception as exc:
            self.error = f"{type(exc).__name__} in a deferred graph capture: {exc}"

    def step(self) -> list[EngineOutput]:
        outputs = self._step()
        if self._kv_log is not None:
            events = self._kv_log.take()
            if events:
                self.kv_events.publish(events)
        return outputs

    def _step(self) -> list[EngineOutput]:
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            runner_output = ModelRunnerOutput(results=[])
        else:
            try:
                started = time.perf_counter()
                runner_output = self.runner.execute(plan)
                # NOTE: less a graph capture the step ran first (a lazy bucket's first step): priced as prompt work
                # it put the stall budget in debt for many steps (session 20, served 256 streams: 0.68 of the engine)
                self._observe(plan, time.perf_counter() - started - getattr(self.runner, "step_capture_s", 0.0))
            except RequestExecutionError as exc:
                return self._count(self.scheduler.fail_step(plan, str(exc), exc.req_ids))
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"
                return self._count(self.scheduler.fail_step(plan, self.error))
        return self._count(self.scheduler.update(plan, runner_output))

    def _observe(self, plan, seconds: float) -> None:
        """The step's time to the scheduler: a decode-only step's, or a prefill's rate (with decodes beside the
        prompt chunks, their share at the measured decode step taken out)."""
        scheduler = self.scheduler
        prompt = [len(s.token_ids) for s in plan.scheduled if len(s.token_ids) > 1]
        if not prompt:
            scheduler.observe_decode(seconds)
        elif len(prompt) == len(plan.scheduled) or scheduler.decode_step_ns is None:
            scheduler.observe_prefill(plan.num_scheduled_tokens, seconds)
        else:
            scheduler.observe_prefill(sum(prompt), max(seconds - 1e-9 * scheduler.decode_step_ns, 0.2 * seconds))

    def _count(self, outputs: list[EngineOutput]) -> list[EngineOutput]:
        for output in outputs:
            self._num_generated_tokens += len(output.new_token_ids)
            if output.finish_reason in ("stop", "length"):
                self._num_completed += 1
            elif output.finish_reason == "error":
                self._num_failed += 1
        return outputs

    def metrics(self) -> EngineMetrics:
        scheduler = self.scheduler
        pools = scheduler.pools  # a model with window groups: the pages of every group's pool summed
        host = scheduler.host_cache
        states = scheduler.state_pool
        ckpt = scheduler.checkpoints
        stats = self.runner.stats() if hasattr(self.runner, "stats") else RunnerStats()
        return EngineMetrics(
            prefill_tokens=scheduler.num_prefill_tokens,
            generated_tokens=self._num_generated_tokens,
            completed=self._num_completed,
            failed=self._num_failed,
            active=scheduler.num_running,
            pending=scheduler.num_waiting,
            free_pages=sum(p.num_free_blocks for p in pools),  # cached free pages included: allocation evicts them
            total_pages=sum(p.num_blocks for p in pools),
            page_tokens=scheduler.block_pool.block_size,
            state_slots_in_use=states.num_slots - states.num_free_slots if states else 0,
            state_slots_total=states.num_slots if states else 0,
            checkpoint_captures=dict(ckpt.captures) if ckpt else {},
            checkpoint_skips=dict(ckpt.skips) if ckpt else {},
            checkpoint_extra_work_ns=int(ckpt.extra_work_ns) if ckpt else 0,
            checkpoints_held=ckpt.num_held if ckpt else 0,
            checkpoint_anchor_reservations=ckpt.num_guards if ckpt else 0,
            host_missing_tokens=_histogram(scheduler.host_lookups.missing_tokens),
            host_estimated_transfer_ns=_histogram(scheduler.host_lookups.transfer_ns),
            host_estimated_prefill_ns=_histogram(scheduler.host_lookups.prefill_ns),
            reused_tokens=scheduler.num_reused_tokens,
            cached_pages=sum(p.num_cached_blocks for p in pools),
            preemptions=scheduler.num_preemptions,
            reasoning_budget_cuts=scheduler.num_reasoning_budget_cuts,
            verify_steps=scheduler.num_decode_steps,
            verification_rounds=scheduler.num_decode_rounds,
            host_hits=host.num_hits if host else 0,
            host_reused_tokens=host.num_reused_tokens if host else 0,
            host_memory_records=host.num_records if host else 0,
            host_bytes_out=host.num_bytes_out if host else 0,
            host_bytes_in=host.num_bytes_in if host else 0,
            host_disk_records=host.num_disk_records if host else 0,
            **msgspec.structs.asdict(stats),  # the runner's counters: every RunnerStats field is one of ours
            **_host_retention([h for h in (host, scheduler.state_host) if h is not None]),
        )


def _host_retention(tiers: list[HostCache]) -> dict:
    """The host retention fields summed over the page records' and the state records' indexes."""
    held = dict.fromkeys(TIERS, 0)
    dropped = {tier: dict.fromkeys(DROP_REASONS, 0) for tier in TIERS}
    for h in tiers:
        for tier in TIERS:
            held[tier] += h.num_held[tier]
            for reason in DROP_REASONS:
                dropped[tier][reason] += h.num_dropped[tier][reason]
    num_slots = sum(h.num_slots for h in tiers)
    return dict(host_held=held, host_dropped=dropped, host_parked_records=sum(h.num_parked for h in tiers),
                host_store_skipped=sum(h.num_store_skipped for h in tiers),
                host_slots_in_use=sum(h.num_records for h in tiers), host_slots_total=num_slots,
                host_intake_slots=num_slots)


def _histogram(h: dict) -> Histogram:
    """A snapshot of one of the scheduler's histograms (its lists copied: they keep counting)."""
    return Histogram(bounds=list(h["bounds"]), counts=list(h["counts"]), sum=h["sum"], count=h["count"])
