"""Scheduler and EngineCore with a fake runner: batching, chunking, preemption, stops, cancellation."""

from __future__ import annotations

import math

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import RequestExecutionError
from helios.engine.messages import EngineRequest, SamplingParams
from helios.engine.request import RequestStatus
from helios.engine import scheduler as scheduler_module
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import (Collected, context_token, make_core, page_owners, reference_tokens, request,
                                 run_until_idle)


def assert_idle(core) -> None:
    pool = core.scheduler.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.scheduler.requests and not core.scheduler.running and not core.scheduler.waiting


# --- config -------------------------------------------------------------------------------------


def test_config_bounds_on_construction_and_decode():
    with pytest.raises(ValueError, match="page_size"):
        SchedulerConfig(page_size=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_concurrency=8, max_num_batched_tokens=4)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"num_pages": -1}, SchedulerConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"bogus": 1}, SchedulerConfig)
    cfg = msgspec.convert({"page_size": 8, "num_pages": 10}, SchedulerConfig)
    assert cfg.page_capacity_tokens == 80


def test_config_fields_document_themselves():
    for field in msgspec.inspect.type_info(SchedulerConfig).fields:
        assert isinstance(field.type, msgspec.inspect.Metadata), field.name
        assert field.type.extra_json_schema["description"], field.name
        if not isinstance(field.type.type, msgspec.inspect.BoolType):
            assert field.type.type.ge is not None and field.type.type.le is not None, field.name


# --- basic flow ---------------------------------------------------------------------------------


def test_single_request_tokens_follow_the_model():
    core, runner = make_core()
    req = request("a", prompt_len=10, max_tokens=5)
    core.add_request(req)
    got = run_until_idle(core)
    context = list(req.prompt_token_ids)
    for _ in range(5):
        context.append(context_token(context))
    assert got.tokens["a"] == context[10:]
    final = got.final["a"]
    assert final.finish_reason == "length" and final.stop_token is None and final.num_prompt_tokens == 10
    assert runner.plans[0].new_requests[0].output_token_ids == []
    assert_idle(core)
    m = core.metrics()
    assert (m.prefill_tokens, m.generated_tokens, m.completed, m.failed) == (10, 5, 1, 0)
    assert (m.active, m.pending, m.free_pages, m.total_pages, m.page_tokens) == (0, 0, 64, 64, 4)
    assert (m.reused_tokens, m.cached_pages) == (0, 3)  # 14 tokens computed (the last one never is): 3 pages
    # the first token came from the prefill; each later one from a decode round of one token (no drafts)
    assert (m.verification_rounds, m.verify_steps) == (4, 4)


def test_decode_rounds_count_requests_and_steps_count_forward_passes():
    core, runner = make_core(max_concurrency=4, num_pages=256)
    for i in range(3):
        core.add_request(request(f"r{i}", prompt_len=6, max_tokens=5))
    run_until_idle(core)
    m = core.metrics()
    decode_plans = [p for p in runner.plans if any(len(s.token_ids) == 1 for s in p.scheduled)]
    assert m.verification_rounds == 3 * 4  # 5 tokens each, the first from its prefill
    assert m.verify_steps == len(decode_plans) == 4  # admitted together: batched rounds share their steps
    assert m.generated_tokens == 15


def test_chunked_prefill_respects_chunk_and_budget():
    core, runner = make_core(max_concurrency=4, max_num_batched_tokens=24, prefill_chunk_size=16, num_pages=256)
    for i in range(6):
        core.add_request(request(f"r{i}", prompt_len=50 + i, max_tokens=6))
    got = run_until_idle(core)
    assert len(got.final) == 6
    for plan in runner.plans:
        assert plan.num_scheduled_tokens <= 24
        assert len(plan.scheduled) <= 4
        for s in plan.scheduled:
            assert len(s.token_ids) <= 16
    # a prompt of 50 needs several chunks, some of exactly the chunk size
    assert any(len(s.token_ids) == 16 for p in runner.plans for s in p.scheduled)
    assert_idle(core)


def test_long_prefill_does_not_stall_running_decodes():
    core, runner = make_core(max_concurrency=4, max_num_batched_tokens=16, prefill_chunk_size=16, num_pages=256)
    core.add_request(request("short", prompt_len=4, max_tokens=30))
    core.step()
    core.add_request(request("long", prompt_len=200, max_tokens=2))
    while "long" in core.scheduler.requests:
        core.step()
        plan = runner.plans[-1]
        if "short" in core.scheduler.requests:
            assert "short" in {s.req_id for s in plan.scheduled}, "the decode skipped a step"
    run_until_idle(core)
    assert_idle(core)


def test_decode_stall_ratio_limits_prompt_tokens_beside_decodes(monkeypatch):
    """With decode_stall_ratio, a step holding decodes takes only the prompt tokens the measured prefill rate does in
    ratio decode steps (here 1 ms / 0.1 ms per token = 10 tokens; a long prompt, then a second one admitted beside
    it, share them); a step without decodes takes the whole budget; every token is what the model gives."""
    # the budget alone: the queue head's bounded wait (STALL_MAX_WAIT_STEPS) has its own test
    monkeypatch.setattr(scheduler_module, "STALL_MAX_WAIT_STEPS", 1 << 30)
    core, runner = make_core(max_concurrency=4, max_num_batched_tokens=256, prefill_chunk_size=128, num_pages=256,
                             decode_stall_ratio=1.0)
    sched = core.scheduler
    sched.observe_decode = sched.observe_prefill = lambda *args: None  # fixed rates: the fake runner takes no time
    sched.decode_step_ns, sched.prefill_ns_per_token = 1e6, 1e5
    short, long, second = (request("short", prompt_len=4, max_tokens=40), request("long", prompt_len=120, max_tokens=3),
                           request("second", prompt_len=30, max_tokens=3))
    core.add_request(short)
    got = Collected()
    got.add(core.step())
    core.add_request(long)
    core.add_request(second)
    while "short" in sched.requests:
        got.add(core.step())
        plan = runner.plans[-1]
        prompt_tokens = sum(len(s.token_ids) for s in plan.scheduled if len(s.token_ids) > 1)
        assert prompt_tokens <= 10, plan
    assert {s.req_id for p in runner.plans[1:] for s in p.scheduled} >= {"long", "second"}
    run_until_idle(core, got)
    for req in (short, long, second):
        assert got.tokens[req.req_id] == reference_tokens(req), req.req_id
    assert_idle(core)
    # no decode beside it: the whole chunk
    core.add_request(request("alone", prompt_len=120, seed=7, max_tokens=1))
    core.step()
    assert len(runner.plans[-1].scheduled[0].token_ids) == 120


def test_prompt_step_cap_limits_tokens_and_chunks_beside_decodes():
    """prompt_step_tokens / prompt_step_seqs (a runner's prompt graphs: what one graph holds): a step holding decodes
    takes at most that many prompt tokens and chunks, running prefills first; a step without decodes is not capped;
    the stall budget stays off (ratio 0); every token is what the model gives."""
    core, runner = make_core(max_concurrency=8, max_num_batched_tokens=256, prefill_chunk_size=128, num_pages=512,
                             prompt_step_tokens=24, prompt_step_seqs=2)
    first = request("first", prompt_len=30, max_tokens=30)
    core.add_request(first)
    got = Collected()
    got.add(core.step())
    assert len(runner.plans[-1].scheduled[0].token_ids) == 30  # nothing decodes yet: the whole prompt
    others = [request(f"r{i}", prompt_len=10 + 7 * i, seed=i, max_tokens=4) for i in range(5)]
    for req in others:
        core.add_request(req)
    capped = 0
    while "first" in core.scheduler.requests:
        got.add(core.step())
        plan = runner.plans[-1]
        chunks = [s for s in plan.scheduled if len(s.token_ids) > 1]
        assert sum(len(s.token_ids) for s in chunks) <= 24 and len(chunks) <= 2, plan
        capped += bool(chunks)
    assert capped >= 4  # 115 prompt tokens at 24 a step
    run_until_idle(core, got)
    for req in (first, *others):
        assert got.tokens[req.req_id] == reference_tokens(req), req.req_id
    assert_idle(core)


def test_one_pass_holds_a_prompt_back_one_step_after_a_decode_only_step():
    """one_pass_rows (a runner that runs a step of prompts beside decodes in one pass): after a decode-only step (the
    runner runs its successor ahead), a waiting prompt that fits is held back one step, that plan says hold_ahead
    (not run ahead), and the next takes the prompt beside the decodes; after a mixed step, or with too many rows
    running, or without one_pass_rows, a prompt is taken at once. Every token is what the model gives."""

    def admitted_after(one_pass_rows: int, num_decoding: int, prompt_len: int = 10) -> tuple[int, list[bool]]:
        core, runner = make_core(max_concurrency=8, max_num_batched_tokens=256, prefill_chunk_size=128,
                                 num_pages=512, prompt_step_tokens=128, prompt_step_seqs=8, one_pass_rows=one_pass_rows,
                                 one_pass_prompt_tokens=64)
        got = Collected()
        first = [request(f"d{i}", prompt_len=4, seed=i, max_tokens=30) for i in range(num_decoding)]
        for req in first:
            core.add_request(req)
        got.add(core.step())  # their prompts: a mixed-free prompt step
        got.add(core.step())  # decode only
        later = request("later", prompt_len=prompt_len, seed=9, max_tokens=3)
        core.add_request(later)
        steps = 0
        while not any(s.req_id == "later" for s in runner.plans[-1].scheduled):
            got.add(core.step())
            steps += 1
        holds = [plan.hold_ahead for plan in runner.plans]
        run_until_idle(core, got)
        for req in (*first, later):
            assert got.tokens[req.req_id] == reference_tokens(req), req.req_id
        assert_idle(core)
        return steps, holds

    steps, holds = admitted_after(8, 3)
    assert steps == 2 and holds[-2:] == [True, False]  # held one step, then taken (beside the three decodes)
    assert admitted_after(0, 3) == (1, [False] * 3)  # no one-pass steps: taken at once
    assert admitted_after(3, 3)[0] == 1  # a fourth row would not fit the one-pass rows
    assert admitted_after(8, 3, prompt_len=62)[0] == 1  # 3 decodes + 62 prompt tokens exceed the 64-token cap


def test_the_one_pass_prompt_cap_applies_only_where_a_step_may_run_in_one_pass():
    """one_pass_prompt_tokens caps a step's prompt tokens beside decodes while fewer than one_pass_rows requests run;
    with more, no step runs in one pass, and prompt_step_tokens (the prompt graphs' largest bucket) is the cap."""

    def first_chunk(one_pass_rows: int) -> int:
        core, runner = make_core(max_concurrency=8, max_num_batched_tokens=512, prefill_chunk_size=256,
                                 num_pages=512, prompt_step_tokens=128, prompt_step_seqs=8, one_pass_rows=one_pass_rows,
                                 one_pass_prompt_tokens=32)
        got = Collected()
        for i in range(3):
            core.add_request(request(f"d{i}", prompt_len=4, seed=i, max_tokens=8))
        got.add(core.step())
        got.add(core.step())  # decode only: with one-pass steps, the next step holds the prompt back
        core.add_request(request("later", prompt_len=200, seed=9, max_tokens=2))
        while not any(s.req_id == "later" for s in runner.plans[-1].scheduled):
            got.add(core.step())
        (chunk,) = [len(s.token_ids) for s in runner.plans[-1].scheduled if s.req_id == "later"]
        run_until_idle(core, got)
        assert_idle(core)
        return chunk

    assert first_chunk(8) == 32  # the one-pass cap (prompt tokens: the decode rows are not counted)
    assert first_chunk(3) == 128  # three running fill the one-pass rows: the prompt graphs' cap


def test_the_stall_budget_holds_the_queue_head_back_a_bounded_number_of_steps():
    """With decode_stall_ratio the prompt budget can be zero step after step (here a debt it never pays back, as a
    budget that shrank with the running set did under load); the head of the waiting queue then waits at most
    STALL_MAX_WAIT_STEPS steps before a step takes its prompt (the caps and token budget still apply)."""
    from helios.engine.scheduler import STALL_MAX_WAIT_STEPS

    core, runner = make_core(max_concurrency=4, max_num_batched_tokens=256, prefill_chunk_size=128, num_pages=256,
                             decode_stall_ratio=1.0)
    sched = core.scheduler
    sched.observe_decode = sched.observe_prefill = lambda *args: None
    sched.decode_step_ns, sched.prefill_ns_per_token = 1e6, 1e5
    first, later = request("first", prompt_len=4, max_tokens=40), request("later", prompt_len=20, max_tokens=3)
    core.add_request(first)
    got = Collected()
    got.add(core.step())
    sched._stall_debt_ns = 1e15  # never repaid at 1 ms a step
    core.add_request(later)
    steps = 0
    while not any(s.req_id == "later" for s in runner.plans[-1].scheduled) and steps < 30:
        got.add(core.step())
        steps += 1
    assert steps == STALL_MAX_WAIT_STEPS + 1
    run_until_idle(core, got)
    for req in (first, later):
        assert got.tokens[req.req_id] == reference_tokens(req), req.req_id
    assert_idle(core)


def test_prompt_cost_fit_separates_the_fixed_part():
    """observe_prefill fits fixed + n * per_token over the recent steps: prompt steps of 16 and 9 tokens with a
    30 ms fixed part (a GPU's eager pass beside the decode graph) give back 30 ms and 27 us a token, not the ~2 ms a
    token a per-token average of such steps reads; steps that all take the same count keep the last split."""
    core, _ = make_core()
    sched = core.scheduler
    fixed, per_token = 30e6, 27e3
    for n in (16, 16, 9, 16, 16, 16, 9):
        sched.observe_prefill(n, 1e-9 * (fixed + n * per_token))
    assert sched.prefill_fixed_ns == pytest.approx(fixed, rel=1e-6)
    assert sched.prefill_ns_per_token == pytest.approx(per_token, rel=1e-6)
    for _ in range(60):  # one count only: the split stays
        sched.observe_prefill(64, 1e-9 * (fixed + 64 * per_token))
    assert sched.prefill_fixed_ns == pytest.approx(fixed, rel=1e-3)
    assert sched.prefill_ns_per_token == pytest.approx(per_token, rel=1e-2)
    core, _ = make_core()
    sched = core.scheduler
    for _ in range(3):  # unseparated from the start: all per token, as an average
        sched.observe_prefill(16, 0.016)
    assert (sched.prefill_fixed_ns, sched.prefill_ns_per_token) == (0.0, pytest.approx(1e6))


def test_a_fixed_prompt_cost_runs_large_chunks_and_pays_them_back(monkeypatch):
    """Where a prompt step's fixed part alone overruns the stall allowance (30 ms against a 6 ms decode step), the
    budget is not a page a step (the prompts would trickle in and hold the decode batch small) but at least what
    the fixed part costs in tokens, and the decode steps after such a step carry no prompt tokens until its excess
    is paid back at the allowance a step: prompt work stays within ratio / (1 + ratio) of the time."""
    # the budget alone: the queue head's bounded wait (STALL_MAX_WAIT_STEPS) has its own test
    monkeypatch.setattr(scheduler_module, "STALL_MAX_WAIT_STEPS", 1 << 30)
    core, runner = make_core(max_concurrency=16, max_num_batched_tokens=2048, prefill_chunk_size=2048,
                             num_pages=1024, decode_stall_ratio=1.0)
    sched = core.scheduler
    sched.observe_decode = sched.observe_prefill = lambda *args: None  # fixed costs: the fake runner takes no time
    fixed, per_token, step = 30e6, 27e3, 6e6
    sched.decode_step_ns, sched.prefill_fixed_ns, sched.prefill_ns_per_token = step, fixed, per_token
    got = Collected()
    reqs = [request("decoding", prompt_len=4, max_tokens=120)]
    core.add_request(reqs[0])
    got.add(core.step())
    reqs += [request(f"p{i}", prompt_len=121, seed=i, max_tokens=20) for i in range(12)]
    for req in reqs[1:]:
        core.add_request(req)
    counts = []
    while "decoding" in sched.requests:
        got.add(core.step())
        counts.append(sum(len(s.token_ids) for s in runner.plans[-1].scheduled if len(s.token_ids) > 1))
    assert counts[0] >= int(fixed / per_token), counts  # one large chunk: 1111 tokens, not a page
    prompt_time = decode_time = 0.0
    i = 0
    while i < len(counts) and any(counts[i:]):
        n = counts[i]
        assert n, (i, counts)
        cost = fixed + n * per_token
        quiet = math.ceil((cost - step) / step - 1e-9)  # the steps that pay the excess back
        assert counts[i + 1 : i + 1 + quiet] == [0] * quiet, (i, counts)
        prompt_time, decode_time = prompt_time + cost, decode_time + (1 + quiet) * step
        i += 1 + quiet
    assert prompt_time <= decode_time + fixed  # ratio 1: at most half the time, give or take the last step's
    run_until_idle(core, got)
    for req in reqs:
        assert got.tokens[req.req_id] == reference_tokens(req), req.req_id
    assert_idle(core)


def test_no_starvation_long_prompt_among_many_short():
    core, _ = make_core(max_concurrency=3, max_num_batched_tokens=8, prefill_chunk_size=8, num_pages=40, max_waiting=64)
    core.add_request(request("long", prompt_len=120, max_tokens=4))
    for i in range(30):
        core.add_request(request(f"s{i}", prompt_len=3, max_tokens=3))
    got = run_until_idle(core)
    assert set(got.final) == {"long"} | {f"s{i}" for i in range(30)}
    assert all(o.finish_reason == "length" for o in got.final.values())
    assert_idle(core)


def test_first_come_order_for_equal_work():
    core, _ = make_core(max_concurrency=2, num_pages=256, max_waiting=64)
    ids = [f"r{i:02d}" for i in range(10)]
    for rid in ids:
        core.add_request(request(rid, prompt_len=8, max_tokens=4))
    got = run_until_idle(core)
    assert got.finish_order == ids


def test_queue_full_and_invalid_requests():
    # two model slots and two waiting places: the first two requests take the free slots, two more wait
    core, _ = make_core(max_concurrency=2, max_waiting=2, max_model_len=32, num_pages=4)
    for req_id in "abcd":
        core.add_request(request(req_id))
    with pytest.raises(QueueFull, match=r"the model request queue is full \(2 waiting\)"):
        core.add_request(request("x"))
    with pytest.raises(ValueError, match="already active"):
        core.add_request(request("a"))
    with pytest.raises(ValueError, match="empty"):
        core.add_request(request("e", prompt_len=0))
    with pytest.raises(ValueError, match="max_model_len"):
        core.add_request(request("f", prompt_len=32))
    with pytest.raises(ValueError, match="page capacity"):
        core.add_request(request("g", prompt_len=17, max_tokens=0))  # 4 pages x 4 tokens
    m = core.metrics()
    assert (m.failed, m.pending) == (5, 4)
    core.step()  # admits a and b: two still wait, and no slot is free
    assert (core.metrics().active, core.metrics().pending) == (2, 2)
    with pytest.raises(QueueFull):
        core.add_request(request("x"))
    got = run_until_idle(core)
    core.add_request(request("x"))
    core.add_request(request("h", prompt_len=16, max_tokens=0))  # exactly the page capacity: scoring fits
    run_until_idle(core, got)
    assert set(got.final) == {"a", "b", "c", "d", "x", "h"}
    assert all(o.finish_reason == "length" for o in got.final.values())
    assert_idle(core)


def test_the_waiting_bound_counts_only_requests_beyond_the_free_slots():
    """Issue 19: requests a free model slot takes at the next step (an n=2 group's choices on an idle server)
    never count against max_waiting; only those that must wait for a slot do."""
    core, _ = make_core(max_concurrency=1, max_waiting=1)
    core.add_request(request("n0"))  # takes the free slot
    core.add_request(request("n1"))  # waits: the one waiting place
    with pytest.raises(QueueFull):
        core.add_request(request("late"))
    core, _ = make_core(max_concurrency=4, max_waiting=1)
    for i in range(5):  # four free slots and one waiting place
        core.add_request(request(f"c{i}"))
    with pytest.raises(QueueFull):
        core.add_request(request("c5"))
    core.step()
    assert (core.metrics().active, core.metrics().pending) == (4, 1)
    got = run_until_idle(core)
    assert len(got.final) == 5 and core.metrics().failed == 1


# --- pages --------------------------------------------------------------------------------------


def test_pages_free_after_completion_and_when_idle():
    core, _ = make_core()
    assert_idle(core)
    for i in range(6):
        core.add_request(request(f"r{i}", prompt_len=5 + i, max_tokens=3 + i))
    core.step()
    assert core.scheduler.block_pool.num_free_blocks < 64
    run_until_idle(core)
    assert_idle(core)


@pytest.mark.parametrize("state", ["waiting", "mid_prefill", "decoding", "preempted", "between_schedule_and_update"])
def test_abort_in_each_state_frees_pages(state):
    core, runner = make_core(max_concurrency=1, max_num_batched_tokens=8, prefill_chunk_size=8)
    core.add_request(request("x", prompt_len=40, max_tokens=50))
    core.add_request(request("y", prompt_len=4, max_tokens=3))
    target = "x"
    if state == "waiting":
        target = "y"
        core.step()
    elif state == "mid_prefill":
        core.step()
        assert not core.scheduler.requests["x"].is_prefill_done
    elif state == "decoding":
        for _ in range(8):
            core.step()
        assert core.scheduler.requests["x"].num_output_tokens > 1
    elif state == "preempted":
        for _ in range(7):
            core.step()
        sched = core.scheduler
        sched.running.remove(req := sched.requests["x"])
        sched._preempt(req)
        assert req.status is RequestStatus.PREEMPTED and not req.block_ids
    if state == "between_schedule_and_update":
        core.step()
        plan = core.scheduler.schedule()
        out = core.abort("x")
        core.scheduler.update(plan, runner.execute(plan))
    else:
        out = core.abort(target)
    assert out.finished and out.finish_reason == "abort" and out.req_id == target
    assert target not in core.scheduler.requests
    assert core.abort(target) is None  # unknown now
    got = run_until_idle(core)
    assert target not in got.final
    assert target not in runner.kv, "the runner was told to drop it"
    assert_idle(core)


def test_alone_at_page_capacity_finishes_with_length():
    # 5 pages x 4 tokens = 20 KV positions; prompt 10 -> at most 11 tokens out (the last one is never fed)
    core, _ = make_core(num_pages=5)
    core.add_request(request("a", prompt_len=10, max_tokens=100))
    got = run_until_idle(core)
    assert got.final["a"].finish_reason == "length"
    assert len(got.tokens["a"]) == 11
    assert got.tokens["a"] == reference_tokens(request("a", prompt_len=10, max_tokens=11))
    assert_idle(core)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_preemption_gives_the_same_tokens(enable_prefix_caching):
    reqs = [request(f"r{i}", prompt_len=6 + 3 * i, seed=i, max_tokens=12 + i) for i in range(6)]
    core, runner = make_core(max_concurrency=6, num_pages=14, prefill_chunk_size=8,
                             enable_prefix_caching=enable_prefix_caching)
    for r in reqs:
        core.add_request(r)
    got = run_until_idle(core)
    assert core.scheduler.num_preemptions > 0
    assert any(n > 1 for n in runner.num_new.values())
    resent = [n for p in runner.plans for n in p.new_requests if n.output_token_ids]
    assert resent, "a preempted request is resent with its outputs so far"
    for r in reqs:
        assert got.final[r.req_id].finish_reason == "length"
        assert got.tokens[r.req_id] == reference_tokens(r), r.req_id
    m = core.metrics()
    num_prompt = sum(len(r.prompt_token_ids) for r in reqs)
    if enable_prefix_caching:  # a request resumed mid-prefill reuses its own cached pages
        assert m.reused_tokens > 0 and m.prefill_tokens < num_prompt <= m.prefill_tokens + m.reused_tokens
    else:
        assert (m.prefill_tokens, m.reused_tokens, m.cached_pages) == (num_prompt, 0, 0)
    # a resumed request's first sample comes from its recompute, not from a decode round (a request resent
    # twice before its next sample resumes once)
    num_resends = sum(1 for p in runner.plans for n in p.new_requests if n.output_token_ids)
    assert m.generated_tokens - len(reqs) - num_resends <= m.verification_rounds < m.generated_tokens - len(reqs)
    assert 0 < m.verify_steps <= m.verification_rounds
    assert_idle(core)


# --- stop rules ---------------------------------------------------------------------------------


def _run_script(script_tokens, **sampling):
    core, _ = make_core(script={"a": script_tokens})
    core.add_request(request("a", **sampling))
    got = run_until_idle(core)
    assert_idle(core)
    return got.tokens["a"], got.final["a"]


def test_eos_stops_and_is_appended():
    tokens, final = _run_script([50, 51, 2, 53], max_tokens=10, eos_token_ids=(2,))
    assert tokens == [50, 51, 2]
    assert (final.finish_reason, final.stop_token) == ("stop", 2)


def test_ignore_eos_runs_to_the_limit_and_reports_length():
    tokens, final = _run_script([50, 2, 2], max_tokens=3, eos_token_ids=(2,), ignore_eos=True)
    assert tokens == [50, 2, 2]
    assert (final.finish_reason, final.stop_token) == ("length", None)


def test_stop_token_ids():
    tokens, final = _run_script([50, 7, 51], max_tokens=10, stop_token_ids=(7, 8))
    assert tokens == [50, 7] and (final.finish_reason, final.stop_token) == ("stop", 7)


def test_stop_token_ids_apply_under_ignore_eos():
    tokens, final = _run_script([2, 7], max_tokens=10, eos_token_ids=(2,), ignore_eos=True, stop_token_ids=(7,))
    assert tokens == [2, 7] and final.stop_token == 7


def test_stop_token_sequences_match_the_output_tail():
    seqs = ((5, 6, 7), (9,))
    tokens, final = _run_script([5, 6, 50, 5, 6, 7, 51], max_tokens=10, stop_token_sequences=seqs)
    assert tokens == [5, 6, 50, 5, 6, 7]
    assert (final.finish_reason, final.stop_token) == ("stop", [5, 6, 7])


def test_stop_sequence_does_not_match_across_the_prompt():
    core, _ = make_core(script={"a": [6, 50]})
    sampling = SamplingParams(max_tokens=2, stop_token_sequences=((5, 6),))
    core.add_request(EngineRequest(req_id="a", prompt_token_ids=[11, 5], sampling=sampling))
    got = run_until_idle(core)
    assert got.tokens["a"] == [6, 50] and got.final["a"].finish_reason == "length"


def test_max_tokens_reports_length():
    tokens, final = _run_script([50, 51, 52, 53], max_tokens=3)
    assert tokens == [50, 51, 52] and final.finish_reason == "length"


@pytest.mark.parametrize(
    "sampling",
    [
        dict(eos_token_ids=(2,)),
        dict(stop_token_ids=(2,)),
        dict(stop_token_sequences=((51, 2),)),
    ],
)
def test_stop_on_the_final_allowed_token_reports_stop(sampling):
    tokens, final = _run_script([50, 51, 2], max_tokens=3, **sampling)
    assert tokens == [50, 51, 2] and final.finish_reason == "stop"


def test_max_model_len_reports_length():
    core, _ = make_core(max_model_len=12)
    core.add_request(request("a", prompt_len=8, max_tokens=100))
    got = run_until_idle(core)
    assert len(got.tokens["a"]) == 4 and got.final["a"].finish_reason == "length"


# --- logprobs -----------------------------------------------------------------------------------


def test_prompt_scoring_and_prompt_logprobs_across_chunks_and_preemption():
    core, runner = make_core(prefill_chunk_size=5, max_num_batched_tokens=8, num_pages=64)
    req = request("p", prompt_len=23, max_tokens=0, prompt_logprobs=2)
    core.add_request(req)
    got = run_until_idle(core)
    outs = got.outputs["p"]
    assert len(outs) == 1 and outs[0].finished and outs[0].finish_reason == "length" and not outs[0].new_token_ids
    records = outs[0].prompt_logprobs
    assert [r.token.token_id for r in records] == req.prompt_token_ids[1:]
    assert all(not s.sample for p in runner.plans for s in p.scheduled)
    assert core.metrics().completed == 1 and core.metrics().generated_tokens == 0

    # prompt logprobs are sent once, with the first token, and survive a mid-prefill preemption
    core, runner = make_core(prefill_chunk_size=5, max_num_batched_tokens=8)
    req = request("q", prompt_len=23, max_tokens=3, prompt_logprobs=0, logprobs=1)
    core.add_request(req)
    core.step()
    core.step()
    sched = core.scheduler
    sched.running.remove(r := sched.requests["q"])
    sched._preempt(r)
    got = run_until_idle(core)
    with_prompt = [o for o in got.outputs["q"] if o.prompt_logprobs is not None]
    assert len(with_prompt) == 1 and with_prompt[0].new_token_ids
    assert [x.token.token_id for x in with_prompt[0].prompt_logprobs] == req.prompt_token_ids[1:]
    for o in got.outputs["q"]:
        assert o.logprobs is not None and [x.token.token_id for x in o.logprobs] == o.new_token_ids
    assert_idle(core)


# --- runner failures ----------------------------------------------------------------------------


def test_runner_exception_fails_the_plan_and_marks_unhealthy():
    boom = {"armed": False}

    def fail(plan):
        return RuntimeError("device lost") if boom["armed"] else None

    core, _ = make_core(fail=fail)
    core.add_request(request("a", max_tokens=50))
    core.add_request(request("b", max_tokens=50))
    core.step()
    boom["armed"] = True
    outs = core.step()
    assert {o.req_id for o in outs} == {"a", "b"}
    for o in outs:
        assert o.finished and o.finish_reason == "error" and "device lost" in o.error
    assert not core.is_healthy and "device lost" in core.error
    assert core.metrics().failed == 2
    assert_idle(core)


def test_request_specific_exception_fails_only_that_request():
    def fail(plan):
        if any(s.req_id == "bad" and s.num_computed_tokens > 0 for s in plan.scheduled):
            return RequestExecutionError(["bad"], "bad grammar")
        return None

    core, _ = make_core(fail=fail)
    good = request("good", prompt_len=7, max_tokens=6)
    core.add_request(good)
    core.add_request(request("bad", prompt_len=30, max_tokens=6))
    got = run_until_idle(core)
    assert got.final["bad"].finish_reason == "error" and got.final["bad"].error == "bad grammar"
    assert got.final["good"].finish_reason == "length"
    assert got.tokens["good"] == reference_tokens(good)
    assert core.is_healthy
    assert_idle(core)


def test_missing_sampled_token_is_a_request_error():
    class Dropper:
        def __init__(self, inner):
            self.inner = inner

        def execute(self, plan):
            out = self.inner.execute(plan)
            return type(out)(results=[r for r in out.results if r.req_id != "a"])

    core, runner = make_core()
    core.runner = Dropper(runner)
    core.add_request(request("a"))
    core.add_request(request("b", max_tokens=2))
    got = run_until_idle(core)
    assert got.final["a"].finish_reason == "error" and got.final["b"].finish_reason == "length"
    assert_idle(core)


# --- property test ------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 12)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, max_size=60),
    num_pages=st.integers(3, 24),
    concurrency=st.integers(1, 5),
    chunk=st.integers(1, 12),
)
def test_random_add_abort_step_keep_pool_invariants(ops, num_pages, concurrency, chunk):
    core, runner = make_core(
        num_pages=num_pages,
        max_concurrency=concurrency,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=max(concurrency, 10),
        max_waiting=8,
        max_model_len=48,
    )
    sched, pool = core.scheduler, core.scheduler.block_pool
    collected = Collected()
    added: list[str] = []

    def check():
        owners = page_owners(sched)
        assert all(pool.ref_count(b) == n == 1 for b, n in owners.items()), "a page owned twice"
        assert len(sched.running) <= concurrency

    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            try:
                core.add_request(request(rid, prompt_len=op[1], max_tokens=op[2], seed=len(added)))
                added.append(rid)
            except (QueueFull, ValueError):
                pass
        elif op[0] == "abort" and added:
            core.abort(added[op[1] % len(added)])
        else:
            for _ in range(op[1]):
                collected.add(core.step())
        check()
    run_until_idle(core, collected)
    check()
    assert_idle(core)
    assert not runner.kv or all(rid not in sched.requests for rid in runner.kv)


def test_resumed_request_past_page_capacity_finishes_with_length():
    core, _ = make_core(num_pages=5)  # 20 KV positions
    core.add_request(request("a", prompt_len=10, max_tokens=100))
    sched = core.scheduler
    collected = Collected()
    while sched.requests["a"].num_tokens < 21:
        collected.add(core.step())
    req = sched.requests["a"]
    sched.running.remove(req)
    sched._preempt(req)  # 21 tokens no longer fit in the pool: it cannot be resumed
    run_until_idle(core, collected)
    assert collected.final["a"].finish_reason == "length" and len(collected.tokens["a"]) == 11
    assert_idle(core)


# --- look-ahead page ------------------------------------------------------------------------------


@pytest.mark.parametrize("num_pages, takes", [(64, True), (3, False)])
def test_a_decode_step_at_a_page_boundary_also_holds_the_next_page_while_pages_are_plenty(num_pages, takes):
    """The step that decodes the last slot of a page also takes the page of the next position (the runner's
    speculative next step needs it in hand), unless the pool is down to a page per running request."""
    core, _ = make_core(page_size=4, num_pages=num_pages, max_concurrency=1)
    core.add_request(request("a", prompt_len=7, max_tokens=5))
    plans = []
    original = core.scheduler.schedule

    def schedule():
        plan = original()
        plans.append(plan)
        return plan

    core.scheduler.schedule = schedule
    got = run_until_idle(core)
    assert len(got.tokens["a"]) == 5
    prefill, decodes = plans[0].scheduled[0], [p.scheduled[0] for p in plans[1:] if p.scheduled]
    assert len(prefill.block_ids) == 2  # 7 prompt tokens: two pages; a prefill never looks ahead
    # decode positions 7, 8, ...: position 7 fills page 2's last slot, so that step may hold page 3 already
    at_boundary = decodes[0]
    assert at_boundary.num_computed_tokens == 7
    assert len(at_boundary.block_ids) == (3 if takes else 2)
    assert all(len(d.block_ids) == 3 for d in decodes[1:])
    assert_idle(core)


def test_a_steps_graph_capture_is_not_priced_as_its_work():
    """A step whose runner first captured a graph (a lazy bucket's first step: runner.step_capture_s) reaches the
    scheduler's cost fit without those seconds: priced as prompt work they put the stall budget in debt."""
    import time

    core, runner = make_core(max_concurrency=2, max_num_batched_tokens=64, prefill_chunk_size=64, num_pages=64)
    seen = []
    core.scheduler.observe_prefill = lambda n, seconds: seen.append(seconds)
    execute = runner.execute

    def capturing(plan):
        runner.step_capture_s = 0.0
        time.sleep(0.05)  # the capture
        runner.step_capture_s = 0.05
        return execute(plan)

    runner.execute = capturing
    core.add_request(request("a", prompt_len=12, max_tokens=1))
    core.step()
    assert len(seen) == 1 and seen[0] < 0.02, seen
    run_until_idle(core)


def test_a_one_off_stall_moves_the_cost_fit_by_a_bounded_step():
    """A single step that stalls (a kernel's first compile: 100x its cost) counts as at most OUTLIER_FACTOR times the
    prediction, and a few normal steps bring the fit back; a lasting change still moves the fit there."""
    from helios.engine.scheduler import OUTLIER_FACTOR

    core, _ = make_core()
    sched = core.scheduler
    fixed, per_token = 5e6, 20e3
    for n in (16, 121, 242, 121, 16, 363):
        sched.observe_prefill(n, 1e-9 * (fixed + n * per_token))
    sched.observe_decode(0.010)
    predicted = fixed + 121 * per_token
    sched.observe_prefill(121, 100 * 1e-9 * predicted)
    assert sched.prefill_fixed_ns + 121 * sched.prefill_ns_per_token <= OUTLIER_FACTOR * predicted
    sched.observe_decode(1.0)  # a 1 s decode step against 10 ms
    assert sched.decode_step_ns <= 0.8 * 10e6 + 0.2 * OUTLIER_FACTOR * 10e6 + 1
    for n in (16, 121, 242, 121, 16, 363) * 6:
        sched.observe_prefill(n, 1e-9 * (fixed + n * per_token))
    assert sched.prefill_fixed_ns + 121 * sched.prefill_ns_per_token == pytest.approx(predicted, rel=0.05)
    for _ in range(30):  # every step now costs 4x: the fit follows (its decay, 0.9 a step)
        sched.observe_prefill(121, 4e-9 * predicted)
    assert sched.prefill_fixed_ns + 121 * sched.prefill_ns_per_token == pytest.approx(4 * predicted, rel=0.1)
