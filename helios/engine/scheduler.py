"""Continuous batching with chunked prefill, recompute preemption and prefix caching, over the paged block pool.

Owns the waiting queue, the running set and every request's pages. One step is
`plan = schedule()` -> runner -> `update(plan, runner_output)`; there are no prefill/decode modes: each
running request gets its next prefill chunk or one decode token, then waiting requests are admitted
first-come-first-served while slots, token budget and pages allow, each starting after the longest run of
cached pages of its tokens (GPU pages, then host records copied in); update() publishes the pages a step
filled. A model with sliding-window layers keeps their pages in window groups (helios/engine/kv_groups.py): every
allocation is made in each group's pool, and update() returns each request's pages before its window. Not
thread-safe: only the engine thread calls it (adds and aborts reach it through AsyncEngine's inbox).
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import math
from collections import deque

from msgspec.structs import replace

from helios.engine.block_pool import BlockPool
from helios.engine.config import SchedulerConfig
from helios.engine.constraint import ConstraintOwner
from helios.engine.host_cache import HostCache, LookupHistograms
from helios.engine.kv_groups import NULL_PAGE, WindowGroup
from helios.engine.messages import (
    EngineOutput,
    EngineRequest,
    ModelRunnerOutput,
    NewRequestData,
    PositionLogprobs,
    ScheduledRequest,
    SchedulerOutput,
)
from helios.engine.prefix_cache import PrefixCache, extend_page_hashes
from helios.engine.request import Request, RequestStatus
from helios.engine.state_checkpoints import StateCheckpoints, candidate_positions
from helios.engine.state_pool import StatePool


UNLIMITED = 1 << 62  # a prompt budget without a bound
# a measured step counts as at most this many times the current cost estimate (observe_prefill, observe_decode)
OUTLIER_FACTOR = 3.0
# the stall budget holds the head of the waiting queue back at most this many steps (then the step takes its prompt
# part up to the token budget and the prompt graphs' cap): its allowance, a multiple of the decode step, shrinks
# with the running set, so under a closed loop of arrivals fewer admissions made fewer running and fewer admissions
# again (session 21, H100 8B at 256 streams: 226 running, 31 queued, TTFT p99 ~1 s; benchmarks/scheduler_sim.py)
STALL_MAX_WAIT_STEPS = 4


class QueueFull(Exception):
    """The bounded waiting queue is full (the server answers 503)."""


class Scheduler:
    def __init__(self, config: SchedulerConfig, constraints: ConstraintOwner | None = None) -> None:
        """constraints: the owner of structured output's grammar state (None: requests with one are refused)."""
        self.config = config
        self.constraints = constraints
        is_host_cache = config.enable_prefix_caching and config.host_cache_pages > 0
        self.block_pool = BlockPool(config.num_pages, config.page_size, track_evictions=is_host_cache)
        self.host_cache = (HostCache(config.host_cache_pages, config.page_bytes, config.host_disk_pages)
                           if is_host_cache else None)
        # the sliding-window layers' page groups, each with its own pool (config forbids host tiers beside them)
        self.window_groups = ([WindowGroup(config.sliding_window, config.window_pages, config.page_size)]
                              if config.window_pages else [])
        self.prefix_cache = (PrefixCache(self.block_pool, self.host_cache, self.window_groups)
                             if config.enable_prefix_caching else None)
        # a hybrid model's recurrent layers: a running request holds a state slot beside its pages.
        # NOTE: pages alone cannot resume such a request (its state at the page boundary is gone): its prefix
        # reuse goes through state checkpoints at grid positions (helios/engine/state_checkpoints.py), with their
        # own host tiers of state records (state_host) beside the page tiers, or there is none
        self.state_pool = None
        self.checkpoints: StateCheckpoints | None = None
        self.checkpoint_grid = 0  # tokens: checkpoints sit on multiples of lcm(page size, recurrent chunk)
        self._state_copies: list[tuple[int, int]] = []  # captures decided by update(), for the next plan
        self._state_copy_out: list[tuple[int, int]] = []  # evicted checkpoints into host records, likewise
        self._state_copy_in: list[tuple[int, int]] = []  # host records into running slots (admissions)
        self.state_host: HostCache | None = None  # the host tiers of state records, named by checkpoint hash
        self.prefill_ns_per_token: float | None = None  # measured by the engine (observe_prefill)
        self.prefill_fixed_ns = 0.0  # a prompt step's cost beyond its tokens', likewise
        self._prefill_fit = [0.0] * 5  # observe_prefill's decayed sums: steps, n, n^2, ns, n * ns
        self.decode_step_ns: float | None = None  # a step of decodes only, likewise (observe_decode)
        self._stall_debt_ns = 0.0  # prompt work beyond the stall allowance, paid back by the next steps
        self.num_steps = 0  # schedule() calls: the waiting queue's ages (Request.queued_at_step)
        self._ran_ahead = False  # the last plan decoded only and was not held: the runner runs its successor ahead
        self.host_lookups = LookupHistograms()
        if config.num_state_slots:
            self.state_pool = StatePool(config.num_state_slots + config.state_checkpoint_slots)
            if self.prefix_cache is not None and config.state_checkpoint_slots:
                self.checkpoints = StateCheckpoints(self.state_pool, config.state_checkpoint_slots,
                                                    config.state_slot_bytes, config.state_copy_bytes_per_s)
                self.checkpoint_grid = math.lcm(config.page_size, config.state_chunk or 1)
                if config.host_state_records:
                    self.state_host = HostCache(config.host_state_records, config.state_slot_bytes,
                                                config.host_state_disk_records)
            else:
                self.prefix_cache = self.host_cache = None
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self.num_prefill_tokens = 0  # prompt tokens of completed prefills (each prompt counted once, less reuse)
        self.num_reused_tokens = 0  # tokens covered by prefix-cache hits, at every admission
        self.num_preemptions = 0
        self.num_reasoning_budget_cuts = 0  # requests whose reasoning the thinking budget closed
        # decode rounds (/metrics' verification fields; without speculation every round has zero drafts): a
        # round is one request fed its last sampled token that committed the next; steps count forward passes
        # holding at least one, so decode_weight_bytes x steps/s is the weight bandwidth decode consumes
        self.num_decode_rounds = 0
        self.num_decode_steps = 0
        self._finished_req_ids: list[str] = []  # for the runner's next plan
        self._pending_outputs: list[EngineOutput] = []  # terminal records decided inside schedule()
        self._scheduled: dict[str, Request] = {}  # the requests of the last plan

    # --- admission and cancellation -----------------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._pending_outputs)

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; raises QueueFull when the waiting queue is full, ValueError when it cannot run."""
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already active")
        if num_prompt == 0:
            raise ValueError("the prompt is empty")
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        # prompt + at least one output token must fit, except for prompt scoring (max_tokens 0)
        limit = self.config.max_model_len - (1 if max_tokens > 0 else 0)
        if num_prompt > limit:
            raise ValueError(f"prompt of {num_prompt} tokens exceeds max_model_len {self.config.max_model_len}")
        if self.block_pool.num_blocks_for(num_prompt) > self.block_pool.num_blocks:
            raise ValueError(
                f"prompt of {num_prompt} tokens exceeds the KV page capacity of {self.config.page_capacity_tokens}"
            )
        # NOTE: the bound counts requests that must wait for a model slot: those a free slot takes at the next
        # step (an n-choice group on an idle server) are not refused (issue 19)
        num_free_slots = max(0, self.config.max_concurrency - len(self.running))
        if len(self.waiting) - num_free_slots >= self.config.max_waiting:
            raise QueueFull(f"the model request queue is full ({self.config.max_waiting} waiting)")
        if request.constraint is not None:
            if self.constraints is None:
                raise ValueError("structured output is not available on this engine (no constraint owner)")
            self.constraints.open(request.req_id, request.constraint)
        req = Request(request)
        req.queued_at_step = self.num_steps
        self.requests[req.req_id] = req
        self.waiting.append(req)

    def abort(self, req_id: str) -> EngineOutput | None:
        """Cancel a request in any state; its pages are free on return. None when the id is unknown."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.finish(RequestStatus.FINISHED_ABORTED)
        self._release(req)
        return self._output(req)

    # --- one step -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        config = self.config
        pool = self.block_pool
        budget = config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        copy_in: list[tuple[int, int]] = []
        self._scheduled = {}
        is_preempted = False

        # prompt tokens this step may take beside the decodes: the stall budget (decode_stall_ratio), and the cap of
        # prompt tokens and chunks that fit the runner's prompt graphs (prompt_step_tokens / _seqs)
        decoding = any(r.num_tokens - r.num_computed_tokens == 1 for r in self.running)
        self.num_steps += 1
        stall_budget = self._prompt_budget(decoding)
        if self.waiting and self.num_steps - self.waiting[0].queued_at_step > STALL_MAX_WAIT_STEPS:
            stall_budget = UNLIMITED  # the queue's head waited long enough: the caps alone
        one_pass = len(self.running) < min(config.one_pass_rows, config.max_concurrency)  # may fit one pass
        step_tokens = config.one_pass_prompt_tokens if one_pass and config.one_pass_prompt_tokens else \
            config.prompt_step_tokens
        prompt_budget = initial_prompt_budget = min(
            stall_budget, step_tokens if decoding and step_tokens else UNLIMITED)
        seqs_left = config.prompt_step_seqs if decoding and config.prompt_step_seqs else UNLIMITED
        # one-pass steps: this step's decodes already run ahead (the last step decoded only), so a prompt taken now
        # is a second pass over the weights; held back one step, it rides with the next step's decodes in one
        hold_ahead = bool(
            one_pass and self._ran_ahead and self.waiting and decoding
            and len(self.running) + min(self.waiting[0].num_tokens, config.prefill_chunk_size) <= step_tokens)
        if hold_ahead:
            seqs_left = 0

        # Running requests first, in admission order. NOTE: each keeps one token of budget for every
        # running request after it (max_num_batched_tokens >= max_concurrency), so a long prefill never
        # stalls the decodes admitted after it.
        running = self.running
        i = 0
        while i < len(running):
            req = running[i]
            reserve = len(running) - i - 1
            # NOTE: the fast path of a request in pure decode (one token left to feed) whose position lies in the
            # pages it holds (usually taken by the look-ahead): exactly what the general path below decides for it
            # (it fits the pool, _chunk_size keeps its one token, it needs no page and preempts nothing), minus
            # the calls that find so; at batch 256 this loop is most of schedule()'s host time
            n = req.num_computed_tokens
            if req.num_tokens == n + 1 and budget > reserve and pool.num_blocks_for(n + 1) == len(req.block_ids):
                scheduled.append(self._schedule_chunk(req, 1))
                budget -= 1
                i += 1
                continue
            if self._exceeds_page_capacity(req):
                self.running.pop(i)
                self._finish_now(req, RequestStatus.FINISHED_LENGTH)
                continue
            num_left = req.num_tokens - req.num_computed_tokens
            prompt_room = max(prompt_budget, 0) if seqs_left > 0 else 0
            num_new = self._chunk_size(req, min(num_left, config.prefill_chunk_size, budget - reserve,
                                                prompt_room if num_left > 1 else 1))
            if num_left > 1:
                prompt_budget -= num_new
                seqs_left -= 1 if num_new else 0
            if num_new == 0:  # a prefill chunk that cannot end on the recurrent grid this step: the next one
                i += 1
                continue
            num_needed = pool.num_blocks_for(req.num_computed_tokens + num_new) - len(req.block_ids)
            while not self._can_allocate(num_needed):
                # recompute preemption of the most recently admitted request, possibly this one; the
                # oldest request always fits alone, so it always progresses (no livelock)
                victim = self.running.pop()
                self._preempt(victim)
                is_preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # it preempted itself, and it was the last running request
            self._allocate(req, num_needed)
            scheduled.append(self._schedule_chunk(req, num_new))
            budget -= num_new
            i += 1

        # Then waiting requests, strictly first-come-first-served (the head blocks the queue, so a long
        # prompt is never overtaken forever); none when this step had to preempt.
        while (not is_preempted and self.waiting and len(self.running) < config.max_concurrency and budget > 0
               and seqs_left > 0):
            req = self.waiting[0]
            if self._exceeds_page_capacity(req):  # a resumed request that grew past the pool
                self.waiting.popleft()
                self._finish_now(req, RequestStatus.FINISHED_LENGTH)
                continue
            assert not req.block_ids and req.num_computed_tokens == 0, req
            hits, host_slots, restore = [], [], None
            group_hits: list[list[int]] = [[] for _ in self.window_groups]
            if self.prefix_cache is not None:
                hits = self.prefix_cache.match(req)
                if self.window_groups:  # pages only as far as each window group has its window's pages
                    num_hits, group_hits = self.prefix_cache.match_windows(req, len(hits))
                    hits = hits[:num_hits]
                host_slots = self.prefix_cache.match_host(req, len(hits))
                if self.checkpoints is not None:  # pages only up to a checkpoint of the recurrent state
                    restore = self._find_checkpoint(req, len(hits) + len(host_slots))
                    num_pages = restore[0] if restore is not None else 0
                    hits, host_slots = hits[:num_pages], host_slots[: max(0, num_pages - len(hits))]
            num_reused = (len(hits) + len(host_slots)) * pool.block_size
            skipped = self._select_checkpoints(req, num_reused) if self.checkpoints is not None else []
            num_new = self._chunk_size(req, min(req.num_tokens - num_reused, config.prefill_chunk_size, budget,
                                                max(prompt_budget, 0)), num_reused)
            if num_new == 0:
                break
            # host pages are fresh pages too (num_needed counts them); hits still on the free list leave it when
            # taken, so they count against it too
            num_needed = pool.num_blocks_for(num_reused + num_new) - len(hits)
            if not self._can_allocate(num_needed, hits, group_hits):
                break
            if self.state_pool is not None:
                # the running share: num_state_slots (the rest of the pool is the checkpoints', which never take
                # a running request's slot, so one is free while fewer run)
                if len(self.running) >= config.num_state_slots or not self.state_pool.can_allocate():
                    break
                req.state_slot = self.state_pool.allocate()
                if restore is not None:
                    self._restore(req, *restore)
            self.waiting.popleft()
            pool.incref(hits)  # NOTE: before allocate(), which would otherwise evict free hits
            req.block_ids = list(hits)  # a copy: hits is read again below
            req.group_block_ids = group_hits
            for group, table in zip(self.window_groups, group_hits):
                group.pool.incref(b for b in table if b != NULL_PAGE)
            self._allocate(req, num_needed)
            if skipped or req.checkpoint_plan:
                self._commit_checkpoint_plan(req, skipped)
            if host_slots:
                copy_in.extend(self.prefix_cache.restore(req, len(hits), host_slots))
            req.num_published_pages = len(hits) + len(host_slots)
            req.num_computed_tokens = req.num_reused_tokens = num_reused
            if req.status is RequestStatus.WAITING:  # the first admission: usage reports this reuse
                req.num_cached_tokens = num_reused
            if self.host_cache is not None or self.state_host is not None:
                self._observe_lookup(req, num_reused, len(host_slots), restore)
            self.num_reused_tokens += num_reused
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            req.is_known_to_runner = True
            new_requests.append(
                NewRequestData(
                    req_id=req.req_id,
                    prompt_token_ids=list(req.prompt_token_ids),
                    sampling=req.sampling,
                    output_token_ids=list(req.output_token_ids),
                )
            )
            scheduled.append(self._schedule_chunk(req, num_new))
            budget -= num_new
            prompt_budget -= num_new
            seqs_left -= 1

        if stall_budget != UNLIMITED:
            self._charge_prompts(initial_prompt_budget - prompt_budget)
        self._look_ahead(scheduled)
        # after every allocation of the plan (look-ahead pages too), so each eviction is copied out before the
        # forward that overwrites its page
        copy_out = self.prefix_cache.store_evictions() if self.prefix_cache is not None else []
        # the disk tier's operations ride with work only (the runner sees no plan without it): they wait
        spill, disk_drop, load = self.prefix_cache.take_disk_ops() if scheduled and self.prefix_cache else ([], [], [])
        # NOTE: finished ids wait for a plan with work, so the runner is never handed an empty batch.
        finished_req_ids: list[str] = []
        state_ops: dict = {}
        if scheduled:
            finished_req_ids, self._finished_req_ids = self._finished_req_ids, []
            state_ops = self._take_state_ops()
        # NOTE: the runner runs a decode-only step's successor ahead unless told not to (a guess here: it also
        # declines for logprobs, last tokens and the like, and then a held prompt waited one step for nothing)
        self._ran_ahead = bool(scheduled) and not hold_ahead and all(len(s.token_ids) == 1 for s in scheduled)
        return SchedulerOutput(
            new_requests=new_requests,
            scheduled=scheduled,
            finished_req_ids=finished_req_ids,
            num_scheduled_tokens=config.max_num_batched_tokens - budget,
            hold_ahead=hold_ahead,
            copy_out=copy_out,
            copy_in=copy_in,
            spill=spill,
            disk_drop=disk_drop,
            load=load,
            **state_ops,
        )

    def update(self, plan: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineOutput]:
        """Fold the runner's results into request state; returns this step's outputs: records decided in
        schedule() (page-capacity finishes) first, then one per request that produced something, in plan order.
        """
        outputs = self.take_pending_outputs()
        results = {result.req_id: result for result in runner_output.results}
        requests, prefix_cache, groups = self._scheduled, self.prefix_cache, self.window_groups
        num_rounds = 0
        for chunk in plan.scheduled:
            req = requests.get(chunk.req_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted (or reset) while the step ran
            result = results.get(chunk.req_id)
            req.num_computed_tokens += len(chunk.token_ids)
            if prefix_cache is not None and result is not None:  # only KV the runner reported computing
                prefix_cache.publish(req)
                if self.checkpoints is not None:
                    self._capture(req)
            for group, table in zip(groups, req.group_block_ids):
                group.release_before_window(table, req.num_computed_tokens)
            if chunk.want_prompt_logprobs and result is not None and result.prompt_logprobs:
                req.prompt_logprobs.extend(result.prompt_logprobs)
            prompt_logprobs = None
            is_prefill_done = req.is_prefill_done
            if is_prefill_done:
                if not req.is_prefill_counted:
                    req.is_prefill_counted = True
                    # reuse < prompt here: nothing is generated before the prefill completes
                    self.num_prefill_tokens += req.num_prompt_tokens - req.num_reused_tokens
                if req.wants_prompt_logprobs:
                    prompt_logprobs, req.prompt_logprobs = req.prompt_logprobs, []
                    req.is_prompt_logprobs_sent = True
            new_token_ids: list[int] = []
            logprobs = None
            is_forced = chunk.forced_token_id is not None
            if chunk.sample:
                if result is None or result.sampled_token_id is None:
                    req.finish(RequestStatus.FINISHED_ERROR, error=f"runner returned no token for {req.req_id}")
                elif is_forced and result.sampled_token_id != chunk.forced_token_id:
                    req.finish(RequestStatus.FINISHED_ERROR,
                               error=f"runner sampled instead of the forced token for {req.req_id}")
                else:
                    # a decode round: the last sampled token in, the next out (not a prefill's or a resumed
                    # request's first sample)
                    num_rounds += req.is_decoding
                    req.is_decoding = True
                    token_id = result.sampled_token_id
                    new_token_ids = [token_id]
                    logprobs = [result.logprobs] if result.logprobs is not None and not is_forced else None
                    req.append_output_token(token_id)
                    if is_forced:
                        self.num_reasoning_budget_cuts += 1
                    constraint_error = self.constraints.observe(req.req_id, token_id) if req.has_constraint else None
                    if constraint_error is not None:
                        req.finish(RequestStatus.FINISHED_ERROR, error=constraint_error)
                    else:
                        req.check_stop(self.config.max_model_len)
            elif req.sampling.max_tokens == 0 and is_prefill_done:
                req.finish(RequestStatus.FINISHED_LENGTH)  # prompt scoring: zero generated tokens
            is_finished = req.is_finished
            if new_token_ids or prompt_logprobs is not None or is_finished:
                outputs.append(self._output(req, new_token_ids, logprobs, prompt_logprobs,
                                            is_forced and bool(new_token_ids)))
            if is_finished:
                self.running.remove(req)
                self._release(req)
        self._scheduled = {}
        self.num_decode_rounds += num_rounds
        self.num_decode_steps += num_rounds > 0
        return outputs

    def fail_step(self, plan: SchedulerOutput, error: str, req_ids: set[str] | None = None) -> list[EngineOutput]:
        """The runner raised on `plan`: fail `req_ids` (all of the plan when None) with finish_reason "error";
        the plan's other requests are preempted, so the runner gets them afresh."""
        outputs = self.take_pending_outputs()
        # the runner may not have applied the plan's drops; resend them (dropping is idempotent)
        self._finished_req_ids.extend(plan.finished_req_ids)
        # NOTE: a failure naming no request is the runner's unreadable disk record (helios/runner/model_runner.py)
        is_io_error = req_ids is not None and not req_ids
        if self.prefix_cache is not None:
            self.prefix_cache.forget_copies(plan.copy_out, plan.copy_in, plan.spill, plan.disk_drop, plan.load,
                                            is_io_error)
        if self.checkpoints is not None and plan.state_copies:  # captures that may never have run
            self.checkpoints.forget_slots({dst for _, dst in plan.state_copies})
        if self.state_host is not None:  # its records and files as the page tier forgets its own
            self.state_host.forget_disk_ops(plan.state_spill, plan.state_disk_drop, plan.state_load, is_io_error)
            for _, record in plan.state_copy_out:
                self.state_host.discard_slot(record)
        affected = [self._scheduled[c.req_id] for c in plan.scheduled if c.req_id in self._scheduled]
        for req in reversed(affected):  # reversed: preempted ones reach the queue front in admission order
            if req.status is not RequestStatus.RUNNING:
                continue
            self.running.remove(req)
            if req_ids is None or req.req_id in req_ids:
                req.finish(RequestStatus.FINISHED_ERROR, error=error)
                self._release(req)
                outputs.append(self._output(req))
            else:
                self._preempt(req)
        self._scheduled = {}
        return outputs

    def take_pending_outputs(self) -> list[EngineOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    # --- internals ----------------------------------------------------------------------------

    def _exceeds_page_capacity(self, req: Request) -> bool:
        """True when feeding all of the request's tokens needs more pages than the whole pool holds."""
        return self.block_pool.num_blocks_for(req.num_tokens) > self.block_pool.num_blocks

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step with prefill in it took `seconds` for `num_tokens` (decodes beside them taken out): the prompt
        cost fixed + num_tokens * per_token, fitted by least squares over the recent steps (each older step weighs
        0.9 of the next), which the prompt budget, the checkpoint cost rule and the host lookups' predicted prefill
        time read (prefill_fixed_ns, prefill_ns_per_token).

        NOTE: a step with prompt rows costs a fixed part however few they are (on a GPU the eager pass beside the
        decode graph: ~30 ms of host work for an 8B model, H100), so a per-token average taken over small chunks
        prices every token at the fixed part; the prompt budget then shrinks to its floor and keeps the chunks small
        (measured, issue 22: 16 tokens a step, decode batch 16 at 256 streams). While the steps' token counts do not
        vary enough to separate the parts, the last split stays (none yet: all per token).
        A step is taken at no more than OUTLIER_FACTOR times the fit's prediction: a one-off stall inside a step (a
        kernel's first compile, a page-in, a collection) would otherwise price every later prompt step at its size
        and the stall budget would run those steps into debt; a real change still moves the fit that much a step."""
        if num_tokens <= 0 or seconds <= 0:
            return
        ns = 1e9 * seconds
        if self.prefill_ns_per_token is not None:
            ns = min(ns, OUTLIER_FACTOR * (self.prefill_fixed_ns + num_tokens * self.prefill_ns_per_token))
        fit = self._prefill_fit
        for i, value in enumerate((1.0, num_tokens, num_tokens * num_tokens, ns, ns * num_tokens)):
            fit[i] = 0.9 * fit[i] + value
        w, sn, snn, sy, sny = fit
        mean_rate = sy / sn
        spread = w * snn - sn * sn
        if spread > 1e-3 * sn * sn:
            # a floor on the slope: noise, or a fixed part that is all of the cost, leaves the budget finite (a
            # large chunk then measures the slope again)
            per_token = max((w * sny - sn * sy) / spread, 0.01 * mean_rate)
            fixed = max((sy - per_token * sn) / w, 0.0)
        else:
            fixed = min(self.prefill_fixed_ns, 0.99 * sy / w)
            per_token = (sy - fixed * w) / sn
        self.prefill_fixed_ns, self.prefill_ns_per_token = fixed, per_token

    def observe_decode(self, seconds: float) -> None:
        """A step of decodes only took `seconds`: the decode step the prompt budget is priced against (a moving
        average; a step over OUTLIER_FACTOR times it counts as that much, as in observe_prefill)."""
        if seconds <= 0:
            return
        ns, prev = 1e9 * seconds, self.decode_step_ns
        self.decode_step_ns = ns if prev is None else 0.8 * prev + 0.2 * min(ns, OUTLIER_FACTOR * prev)

    def _prompt_budget(self, decoding: bool) -> int:
        """The prompt tokens this step may take (running prefills and admissions together): unlimited without
        decode_stall_ratio, without a decoding request or before both costs are measured; none while the prompt
        steps are in debt; else what fits decode_stall_ratio decode steps at the fitted cost (fixed + per token),
        but at least a page and a recurrent chunk (a split chunk must reach the next grid position: the prompts
        always progress) and at least as many tokens as the fixed part costs (it is then at most half the chunk's).

        NOTE: stall-free batching (Sarathi-Serve's idea): a step's prompt chunks stretch every decoding request's
        inter-token gap, so under a stream of arrivals the gaps' tail would follow the prompts' sizes; this bounds
        it at (1 + ratio) decode steps where the fixed part allows, at the cost of a burst's later prompts waiting a
        few steps longer. Where the fixed part alone overruns that, a prompt step runs a large chunk and the decode
        steps after it pay its excess back (_charge_prompts): prompt work stays within ratio / (1 + ratio) of the
        time instead of shrinking to a page a step. schedule() lifts it once the queue's head waited more than
        STALL_MAX_WAIT_STEPS steps."""
        ratio, per_token, step = self.config.decode_stall_ratio, self.prefill_ns_per_token, self.decode_step_ns
        if not ratio or per_token is None or step is None:
            return UNLIMITED
        if not decoding:  # no request decodes: nothing to stall
            self._stall_debt_ns = 0.0
            return UNLIMITED
        if self._stall_debt_ns > 0:
            return 0
        fixed, allowance = self.prefill_fixed_ns, ratio * step
        floor = max(self.config.page_size, self.config.state_chunk)
        return max(floor, int((allowance - fixed) / per_token), int(fixed / per_token))

    def _charge_prompts(self, num_tokens: int) -> None:
        """A step beside decodes took num_tokens prompt tokens under a limited budget: their predicted cost beyond
        the step's allowance is debt, which the steps after it pay at their allowance each."""
        allowance = self.config.decode_stall_ratio * self.decode_step_ns
        cost = self.prefill_fixed_ns + num_tokens * self.prefill_ns_per_token if num_tokens else 0.0
        self._stall_debt_ns = max(self._stall_debt_ns + cost - allowance, 0.0)

    def _observe_lookup(self, req: Request, num_reused: int, num_host_pages: int, restore) -> None:
        """An admission that looked past the GPU: its missing tokens, the predicted copy-in time of the host
        records it takes (pages, a state record) and the predicted prefill of what is left."""
        config = self.config
        nbytes = num_host_pages * config.page_bytes
        if restore is not None and restore[1] == "host":
            nbytes += config.state_slot_bytes
        transfer_ns = 1e9 * nbytes / config.host_copy_bytes_per_s if config.host_copy_bytes_per_s else 0.0
        missing = req.num_tokens - num_reused
        rate = self.prefill_ns_per_token
        self.host_lookups.observe(missing, transfer_ns, missing * rate if rate is not None else None)

    def _find_checkpoint(self, req: Request, num_pages: int) -> tuple[int, str, int | None] | None:
        """The longest grid position within the request's first num_pages reusable pages that has a checkpoint:
        (pages, "gpu", its slot) or (pages, "host", its DRAM record or None for a disk record); None if none."""
        grid_pages = self.checkpoint_grid // self.block_pool.block_size
        for n in range(num_pages - num_pages % grid_pages, 0, -grid_pages):
            block_hash = req.page_hashes[n - 1]
            slot = self.checkpoints.lookup(block_hash)
            if slot is not None:
                return n, "gpu", slot
            if self.state_host is not None:
                entries = self.state_host.find_tiered_prefix([block_hash])
                if entries:
                    return n, "host", entries[0]
        return None

    def _restore(self, req: Request, num_pages: int, tier: str, entry: int | None) -> None:
        """Start the admitted request's running slot from the checkpoint _find_checkpoint chose."""
        if tier == "gpu":
            self._state_copies.append((entry, req.state_slot))
            return
        block_hash = req.page_hashes[num_pages - 1]
        (record,) = self.state_host.take([block_hash], num_pages * self.block_pool.block_size, [entry])
        self._state_copy_in.append((record, req.state_slot))

    def _take_state_ops(self) -> dict:
        """The plan's state slot copies and their host tiers' operations (a plan with work carries them all: every
        checkpoint it captures or restores is whole once it ran)."""
        if self.checkpoints is None:
            return {}
        ops = {"state_copies": self._state_copies, "state_copy_out": self._state_copy_out,
               "state_copy_in": self._state_copy_in}
        self._state_copies, self._state_copy_out, self._state_copy_in = [], [], []
        self.checkpoints.end_step()
        if self.state_host is not None:
            ops["state_spill"], ops["state_disk_drop"], ops["state_load"] = self.state_host.take_disk_ops()
            self.state_host.end_step()
        return ops

    def _keep_evicted(self) -> None:
        """Checkpoints the GPU share let go move to host records (a copy-out before their slot is reused)."""
        evicted, self.checkpoints.evicted = self.checkpoints.evicted, []
        if self.state_host is None:
            return
        for block_hash, slot in evicted:
            record = self.state_host.store(block_hash)
            if record is not None:
                self._state_copy_out.append((slot, record))

    def _select_checkpoints(self, req: Request, num_reused: int) -> list[str]:
        """The anchor and message positions (EngineRequest.anchor_end / message_ends on the grid) the cost rule
        takes for a request admitted at num_reused: set as req.checkpoint_plan (the chunks end there). Returns the
        skip reasons of the others, counted once the admission commits (_commit_checkpoint_plan)."""
        grid, page_size = self.checkpoint_grid, self.block_pool.block_size
        candidates = candidate_positions(req.anchor_end, req.message_ends, num_reused, self._prompt_endpoint(req),
                                         grid)
        if candidates:
            extend_page_hashes(req.page_hashes, req.all_token_ids, page_size, max(candidates) // page_size)
        held = [p for p in candidates if self._is_checkpointed(req.page_hashes[p // page_size - 1])]
        for p in held:  # a checkpoint of that prefix exists: nothing to capture
            del candidates[p]
        req.checkpoint_plan, skipped = self.checkpoints.select(candidates, req.num_prompt_tokens - num_reused,
                                                               self.prefill_ns_per_token)
        return skipped

    def _is_checkpointed(self, block_hash: bytes) -> bool:
        if self.checkpoints.holds(block_hash):
            return True
        return self.state_host is not None and bool(self.state_host.find_tiered_prefix([block_hash]))

    def _prompt_endpoint(self, req: Request) -> int:
        """The prompt's last grid position: its endpoint checkpoint's."""
        return (req.num_prompt_tokens - 1) // self.checkpoint_grid * self.checkpoint_grid

    def _commit_checkpoint_plan(self, req: Request, skipped: list[str]) -> None:
        """An admitted request's checkpoint selection counts its skips and takes its anchor's guard (a slot held
        until it gets there: the anchor's capture cannot then fail for storage)."""
        self.checkpoints.skip(skipped)
        anchor = next((p for p, role in req.checkpoint_plan.items() if role == "anchor"), None)
        if anchor is None:
            return
        block_hash = req.page_hashes[anchor // self.block_pool.block_size - 1]
        if self.checkpoints.reserve(block_hash):
            req.anchor_guard = block_hash
        self._keep_evicted()

    def _release_checkpoint_plan(self, req: Request) -> None:
        """A request leaving the running set (finished, aborted, preempted) gives its unused anchor guard back."""
        req.checkpoint_plan = {}
        if req.anchor_guard is not None:
            self.checkpoints.release(req.anchor_guard)
            req.anchor_guard = None

    def _capture(self, req: Request) -> None:
        """A checkpoint when a step left the request on the checkpoint grid at a position worth one: an anchor or
        message its admission selected, the prompt's last grid position, or one its decode passed (endpoints); a
        prompt without the template's positions (a raw prompt) also keeps its other chunk ends, as endpoints.
        The copy of its running slot rides in the next plan, before anything can write that slot. One its decode
        passed replaces the request's previous decode endpoint (a conversation's next turn wants the latest); the
        prompt's stay (its tokens are the client's own, the decode's may tokenize otherwise when sent back as
        text)."""
        p = req.num_computed_tokens
        if p == 0 or p % self.checkpoint_grid:
            return
        role = req.checkpoint_plan.pop(p, None)
        is_decode = p > req.num_prompt_tokens  # the prompt's own stays: for every request sharing the prompt
        if role is None and p < req.num_prompt_tokens and p != self._prompt_endpoint(req) and (
                req.anchor_end or req.message_ends):
            return  # a chat's prompt chunk end that is no anchor, message or endpoint (a raw prompt keeps them)
        block_hash = req.page_hashes[p // self.block_pool.block_size - 1]
        if role is not None and block_hash == req.anchor_guard:
            req.anchor_guard = None  # the guard becomes the capture's slot
        is_selected = role is not None
        if role is None:  # an endpoint, unless the anchor falls on the same grid position (it is kept as one)
            role = "anchor" if req.anchor_end // self.checkpoint_grid * self.checkpoint_grid == p else "endpoint"
        slot = self.checkpoints.capture(block_hash, p, role, self.prefill_ns_per_token,
                                        req.checkpoint_hash if is_decode else None, is_selected=is_selected)
        self._keep_evicted()
        if slot is None:
            return
        self._state_copies.append((req.state_slot, slot))
        if is_decode:
            req.checkpoint_hash = block_hash

    def _chunk_size(self, req: Request, num_new: int, start: int | None = None) -> int:
        """num_new, or less so that a split prefill chunk of a hybrid model ends on a multiple of the recurrent
        chunk (config.state_chunk): the recurrent layers then run the same arithmetic however the scheduler split
        the prompt (the reference and kernels chunk on absolute positions). 0 when the step's budget cannot reach
        the next multiple: the request waits for a step with more (the first running request always has enough,
        see SchedulerConfig)."""
        grid = self.config.state_chunk
        start = req.num_computed_tokens if start is None else start
        end = start + num_new
        cut = min((p for p in req.checkpoint_plan if start < p < end), default=None)
        if cut is not None:  # an anchor or message checkpoint ends this chunk (a grid position)
            return cut - start
        if grid and self.checkpoint_grid and end == req.num_tokens and num_new > 1:
            # the prompt's last checkpoint position ends a chunk of its own: the state there is captured
            last = (end - 1) // self.checkpoint_grid * self.checkpoint_grid
            if last > start:
                return last - start
        if not grid or end == req.num_tokens:
            return num_new
        return max(0, end - end % grid - start)

    def _look_ahead(self, scheduled: list[ScheduledRequest]) -> None:
        """A decode step's request also takes the page its next position falls in, after every allocation of
        this step and only while the pool keeps a free page for each running request: the runner may then run
        the next decode step before this one's ids are read (helios/runner/decode_overlap.py needs that page in
        hand). The request would take it at its next step anyway; without it, at a high concurrency some
        request of nearly every step sits at a page boundary and no step is ever speculated."""
        pool = self.block_pool
        requests = self._scheduled
        for j, s in enumerate(scheduled):
            if len(s.token_ids) != 1 or not s.sample:
                continue
            req = requests[s.req_id]
            if (
                pool.num_blocks_for(s.num_computed_tokens + 2) > len(req.block_ids)
                and all(p.num_free_blocks > len(self.running) for p in self.pools)
            ):
                self._allocate(req, 1)
                scheduled[j] = replace(s, block_ids=list(req.block_ids),
                                       group_block_ids=[list(t) for t in req.group_block_ids])

    def _schedule_chunk(self, req: Request, num_new: int) -> ScheduledRequest:
        start = req.num_computed_tokens
        end = start + num_new
        req_id = req.req_id
        self._scheduled[req_id] = req
        token_ids = req.all_token_ids
        sample = end == len(token_ids) and req.sampling.max_tokens > 0
        forced_token_id = req.forced_token_id if sample else None
        return ScheduledRequest(
            req_id=req_id,
            token_ids=token_ids[start:end],
            num_computed_tokens=start,
            block_ids=list(req.block_ids),
            group_block_ids=[list(t) for t in req.group_block_ids],
            sample=sample,
            want_prompt_logprobs=req.wants_prompt_logprobs and start < req.num_prompt_tokens,
            state_slot=req.state_slot,
            # NOTE: a running request is never finished here, so the forced token fits the output limit
            forced_token_id=forced_token_id,
            token_mask=(self.constraints.token_mask(req.req_id)
                        if req.has_constraint and sample and forced_token_id is None else None),
        )

    def _preempt(self, req: Request) -> None:
        """Free the (already unlinked) running request's pages and requeue it at the front for recompute."""
        self._free_pages(req)
        self._free_state_slot(req)
        req.num_computed_tokens = req.num_published_pages = 0
        req.status = RequestStatus.PREEMPTED
        req.is_decoding = False
        req.num_preemptions += 1
        if not req.is_prompt_logprobs_sent:
            req.prompt_logprobs = []  # recollected on recompute
        self._forget_in_runner(req)
        req.queued_at_step = self.num_steps
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _finish_now(self, req: Request, status: RequestStatus) -> None:
        """Finish an (already unlinked) request inside schedule(); its record goes out with update()."""
        req.finish(status)
        self._release(req)
        self._pending_outputs.append(self._output(req))

    def _release(self, req: Request) -> None:
        """Free a finished request's pages and forget it; it must already be off the queues."""
        self._free_pages(req)
        self._free_state_slot(req)
        self._forget_in_runner(req)
        if req.has_constraint:
            self.constraints.close(req.req_id)
        del self.requests[req.req_id]

    @property
    def pools(self) -> list[BlockPool]:
        """Every page pool: group 0's (block_pool), then each window group's."""
        return [self.block_pool] + [group.pool for group in self.window_groups]

    def _can_allocate(self, num_needed: int, hits: list[int] = (), group_hits: list[list[int]] = ()) -> bool:
        """Whether every group's pool has num_needed fresh pages beside the free cached hits the request takes
        (they leave the free list when taken): the tables of a request grow together."""
        pool = self.block_pool
        if not pool.can_allocate(num_needed + pool.num_free_among(hits)):
            return False
        for i, group in enumerate(self.window_groups):
            taken = [b for b in group_hits[i] if b != NULL_PAGE] if group_hits else []
            if not group.pool.can_allocate(num_needed + group.pool.num_free_among(taken)):
                return False
        return True

    def _allocate(self, req: Request, num_needed: int) -> None:
        """Extend each of the request's tables by num_needed fresh pages (after _can_allocate)."""
        req.block_ids.extend(self.block_pool.allocate(num_needed))
        for group, table in zip(self.window_groups, req.group_block_ids):
            table.extend(group.pool.allocate(num_needed))

    def _free_pages(self, req: Request) -> None:
        self.block_pool.free(reversed(req.block_ids))  # tail first: the prefix cache keeps heads longer
        req.block_ids = []
        for group, table in zip(self.window_groups, req.group_block_ids):
            group.release(table)
        req.group_block_ids = []

    def _free_state_slot(self, req: Request) -> None:
        if self.checkpoints is not None:
            self._release_checkpoint_plan(req)
        if req.state_slot >= 0:
            self.state_pool.free(req.state_slot)
            req.state_slot = -1

    def _forget_in_runner(self, req: Request) -> None:
        if req.is_known_to_runner:
            req.is_known_to_runner = False
            self._finished_req_ids.append(req.req_id)

    def _output(
        self,
        req: Request,
        new_token_ids: list[int] | None = None,
        logprobs: list[PositionLogprobs] | None = None,
        prompt_logprobs: list[PositionLogprobs] | None = None,
        is_forced: bool = False,
    ) -> EngineOutput:
        finish_reason = req.finish_reason
        return EngineOutput(
            req_id=req.req_id,
            new_token_ids=new_token_ids or [],
            logprobs=logprobs,
            is_forced=is_forced,
            prompt_logprobs=prompt_logprobs,
            finished=finish_reason is not None,  # every finished status has a reason (request.py)
            finish_reason=finish_reason,
            stop_token=req.stop_token,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            error=req.error,
        )
