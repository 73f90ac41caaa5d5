"""The prefix cache's host DRAM tier with the fake runner: pages the GPU pool evicts are copied out to host
records and copied back in at admission. The fake runner's simulated KV (token ids per page and per host record)
checks that every chunk reads exactly its request's tokens, so a wrong copy, a slot overwritten while read or a
stale record fails here."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.engine_core import RequestExecutionError
from helios.engine.host_cache import HostCache
from helios.engine.messages import EngineRequest, SamplingParams
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import Collected, make_core, page_owners, reference_tokens, run_until_idle

PAGE = 4  # make_core's page size
PAGE_BYTES = 1000
TIER = dict(num_pages=12, host_cache_pages=32, page_bytes=PAGE_BYTES)  # 48 GPU positions, 32 host records


def prompt_request(req_id: str, prompt: list[int], **sampling) -> EngineRequest:
    sampling.setdefault("max_tokens", 4)
    return EngineRequest(req_id=req_id, prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def run_one(core, req: EngineRequest, collected: Collected) -> None:
    core.add_request(req)
    run_until_idle(core, collected)


def first_chunk(runner, req_id: str):
    plan = next(p for p in runner.plans if any(n.req_id == req_id for n in p.new_requests))
    return plan, next(s for s in plan.scheduled if s.req_id == req_id)


def assert_idle(core) -> None:
    sched = core.scheduler
    page_owners(sched)
    assert sched.block_pool.num_free_blocks == sched.block_pool.num_blocks
    assert not sched.requests and not sched.running and not sched.waiting
    if sched.host_cache is not None:
        sched.host_cache.check_invariants()


def evict_and_repeat(**config) -> tuple:
    """Prompt A, then three other 30-token prompts (enough to evict A's pages from the 12-page pool), then A
    again; returns (core, runner, collected)."""
    core, runner = make_core(**{**TIER, **config})
    collected = Collected()
    a = tokens(30, seed=1)
    run_one(core, prompt_request("a1", a), collected)
    for i in range(3):
        run_one(core, prompt_request(f"other{i}", tokens(30, seed=10 + i)), collected)
    run_one(core, prompt_request("a2", a), collected)
    return core, runner, collected


def test_a_prompt_evicted_from_the_gpu_pool_is_served_from_the_host_store():
    core, runner, collected = evict_and_repeat()
    plan, chunk = first_chunk(runner, "a2")
    assert chunk.num_computed_tokens == 28  # (30 - 1) // 4 = 7 pages, all from the host records
    assert len(plan.copy_in) == 7 and collected.final["a2"].num_cached_tokens == 28
    assert collected.tokens["a2"] == collected.tokens["a1"] == reference_tokens(prompt_request("a", tokens(30, 1)))
    m = core.metrics()
    assert (m.host_hits, m.host_reused_tokens, m.reused_tokens) == (1, 28, 28)
    assert m.host_bytes_in == 7 * PAGE_BYTES and runner.num_copied_in == 7
    assert m.host_bytes_out == runner.num_copied_out * PAGE_BYTES > 0
    assert 0 < m.host_memory_records <= 32
    assert_idle(core)

    # the same traffic without the tier: A's pages are gone from the pool, nothing is reused
    core, runner, collected = evict_and_repeat(host_cache_pages=0)
    assert collected.final["a2"].num_cached_tokens == 0 and not any(p.copy_out or p.copy_in for p in runner.plans)
    assert core.metrics().host_hits == core.metrics().host_memory_records == 0


def test_host_pages_continue_the_gpu_hits():
    """A prompt whose head is still on the GPU and whose tail was evicted takes both, in that order."""
    core, runner = make_core(**TIER)
    collected = Collected()
    a = tokens(30, seed=1)
    run_one(core, prompt_request("a1", a), collected)
    # a shorter prompt sharing A's first 2 pages keeps them warm (most recently freed) while others evict the rest
    run_one(core, prompt_request("other0", tokens(30, seed=10)), collected)
    run_one(core, prompt_request("head", a[:9], max_tokens=1), collected)
    run_one(core, prompt_request("other1", tokens(26, seed=11)), collected)
    plan, chunk = first_chunk(runner, "head")
    assert chunk.num_computed_tokens == 8
    run_one(core, prompt_request("a2", a), collected)
    plan, chunk = first_chunk(runner, "a2")
    num_host = len(plan.copy_in)
    assert 0 < num_host < 7 and chunk.num_computed_tokens == 28
    assert [b for _, b in plan.copy_in] == chunk.block_ids[7 - num_host : 7]
    assert collected.tokens["a2"] == collected.tokens["a1"]
    assert core.metrics().host_reused_tokens == num_host * PAGE
    assert_idle(core)


def test_prompt_logprob_requests_take_no_host_pages():
    core, runner = make_core(**TIER)
    collected = Collected()
    a = tokens(30, seed=1)
    run_one(core, prompt_request("a1", a), collected)
    for i in range(3):
        run_one(core, prompt_request(f"other{i}", tokens(30, seed=10 + i)), collected)
    run_one(core, prompt_request("a2", a, prompt_logprobs=1), collected)
    plan, chunk = first_chunk(runner, "a2")
    assert chunk.num_computed_tokens == 0 and not plan.copy_in
    assert collected.final["a2"].num_cached_tokens == 0 and core.metrics().host_hits == 0
    assert len(collected.final["a2"].prompt_logprobs or []) + sum(
        len(o.prompt_logprobs or []) for o in collected.outputs["a2"][:-1]) == 29
    assert_idle(core)


def test_a_failed_plan_forgets_its_copies():
    """The runner fails the plan that restores A (before copying anything, as the fake runner does): the pages
    it would have filled and the records it would have written are forgotten, so the next A is served from the
    records it read, not from pages that never got their KV."""
    def fail(plan):
        if plan.copy_in:
            return RequestExecutionError([s.req_id for s in plan.scheduled], "injected")
        return None

    core, runner = make_core(**TIER, fail=fail)
    collected = Collected()
    a = tokens(30, seed=1)
    run_one(core, prompt_request("a1", a), collected)
    for i in range(3):
        run_one(core, prompt_request(f"other{i}", tokens(30, seed=10 + i)), collected)
    run_one(core, prompt_request("a2", a), collected)
    assert collected.final["a2"].finish_reason == "error"
    failed, _ = first_chunk(runner, "a2")
    assert failed.copy_in and failed.copy_out
    written = {slot for _, slot in failed.copy_out}
    assert not written & set(core.scheduler.host_cache.find_prefix(_page_hashes(a))) and core.is_healthy
    runner.fail = None
    run_one(core, prompt_request("a3", a), collected)
    plan, chunk = first_chunk(runner, "a3")
    assert len(plan.copy_in) == 7 and chunk.num_computed_tokens == 28
    assert collected.tokens["a3"] == collected.tokens["a1"]
    assert_idle(core)


def _page_hashes(prompt: list[int]) -> list[bytes]:
    from helios.engine.prefix_cache import extend_page_hashes

    hashes: list[bytes] = []
    extend_page_hashes(hashes, prompt, PAGE, (len(prompt) - 1) // PAGE)
    return hashes


def test_lru_order_and_slot_reuse():
    host = HostCache(3, page_bytes=10)
    h = [bytes([i]) * 32 for i in range(6)]
    assert [host.store(x) for x in h[:3]] == [0, 1, 2]
    host.end_step()
    assert host.store(h[0]) is None  # held: only touched, h[1] is the least recently used now
    assert host.store(h[3]) == 1  # h[1]'s slot
    host.end_step()
    assert host.find_prefix(h[:2]) == [0] and host.find_prefix([h[2], h[3]]) == [2, 1]
    host.take([h[2]], 4)  # an admission reads h[2]: most recent, and pinned for this plan
    assert host.store(h[4]) == 0  # h[0] is the least recently used, not pinned
    host.end_step()
    assert host.find_prefix([h[0]]) == [] and host.num_records == 3
    assert (host.num_hits, host.num_reused_tokens, host.num_bytes_in, host.num_bytes_out) == (1, 4, 10, 50)
    host.discard_slot(1)
    assert host.find_prefix([h[3]]) == [] and host.store(h[5]) == 1
    host.check_invariants()


def test_pinned_slots_are_never_overwritten_in_the_same_plan():
    host = HostCache(2, page_bytes=1)
    h = [bytes([i]) * 32 for i in range(4)]
    assert [host.store(x) for x in h[:2]] == [0, 1]
    host.end_step()
    host.take([h[0]], 4)
    assert host.store(h[2]) == 1  # the only unpinned slot
    assert host.store(h[3]) is None  # slot 1 was written in this plan and slot 0 is read: nothing is stored
    host.end_step()
    assert host.find_prefix([h[0]]) == [0] and host.find_prefix([h[2]]) == [1] and host.find_prefix([h[3]]) == []


def test_a_readmission_that_copies_in_while_a_full_store_takes_evictions():
    """With 20 records (full when A comes back, A's the least recently used), A's re-admission copies its 7
    records in while its fresh pages evict 7 other pages in the same plan: the copy-outs take the next least
    recently used slots, never one the copy-ins read (the fake runner asserts it for every plan)."""
    core, runner, collected = evict_and_repeat(host_cache_pages=20)
    plan, chunk = first_chunk(runner, "a2")
    assert len(plan.copy_in) == len(plan.copy_out) == 7 and chunk.num_computed_tokens == 28
    assert not {s for _, s in plan.copy_out} & {s for s, _ in plan.copy_in}
    assert collected.tokens["a2"] == collected.tokens["a1"]
    assert core.metrics().host_memory_records == 20
    assert_idle(core)


def test_a_small_store_keeps_the_head_of_a_prompt():
    """Pages are freed tail first, so a store too small for all of A keeps its head: a shorter reuse."""
    core, runner, collected = evict_and_repeat(host_cache_pages=16)
    plan, chunk = first_chunk(runner, "a2")
    assert len(plan.copy_in) == 3 and chunk.num_computed_tokens == 12
    assert collected.tokens["a2"] == collected.tokens["a1"]
    assert_idle(core)


# --- property test ------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 12), st.integers(0, 2)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.just("drain")),  # run to idle: the pool's pages are all free, ready to be evicted
    st.tuples(st.just("fail")),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, min_size=8, max_size=60),
    num_pages=st.integers(3, 12),
    host_pages=st.integers(1, 16),
    concurrency=st.integers(1, 5),
    chunk=st.integers(1, 12),
)
def test_random_add_abort_step_keep_pool_invariants_with_the_host_tier(ops, num_pages, host_pages, concurrency,
                                                                        chunk):
    failing: list[bool] = [False]

    def fail(plan):
        if failing[0]:
            failing[0] = False
            return RequestExecutionError([plan.scheduled[0].req_id], "injected")
        return None

    core, runner = make_core(
        fail=fail,
        num_pages=num_pages,
        host_cache_pages=host_pages,
        page_bytes=PAGE_BYTES,
        max_concurrency=concurrency,
        prefill_chunk_size=chunk,
        max_num_batched_tokens=max(concurrency, 10),
        max_waiting=8,
        max_model_len=48,
    )
    sched = core.scheduler
    collected = Collected()
    added: list[str] = []

    def check():
        owners = page_owners(sched)
        assert all(sched.block_pool.ref_count(b) == n for b, n in owners.items()), "a holder not counted"
        sched.host_cache.check_invariants()
        m = core.metrics()
        assert m.host_reused_tokens <= m.reused_tokens
        # planned copies (a failed plan's too: the engine cannot know how far the runner got)
        assert m.host_bytes_in == sum(len(p.copy_in) for p in runner.plans) * PAGE_BYTES
        assert m.host_bytes_out == sum(len(p.copy_out) for p in runner.plans) * PAGE_BYTES

    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            try:
                # few distinct prompt heads (seed), so prompts repeat and their evicted pages come back
                core.add_request(prompt_request(rid, tokens(op[1], seed=op[3]), max_tokens=op[2]))
                added.append(rid)
            except (QueueFull, ValueError):
                pass
        elif op[0] == "abort" and added:
            core.abort(added[op[1] % len(added)])
        elif op[0] == "fail":
            failing[0] = True
        elif op[0] == "drain":
            run_until_idle(core, collected)
        else:
            for _ in range(op[1]):
                collected.add(core.step())
        check()
    failing[0] = False
    run_until_idle(core, collected)
    check()
    assert_idle(core)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(5, 40)), min_size=1, max_size=3),
                   min_size=2, max_size=10),
    num_pages=st.integers(11, 24),
    host_pages=st.integers(1, 24),
)
def test_random_waves_of_repeated_prompts_give_the_tokens_of_the_tier_off(waves, num_pages, host_pages):
    """Waves of prompts from four shared heads, each wave run to idle: with the tier on, every request gives the
    tokens it gives with the tier off, whatever the pool and store sizes (the fake runner checks every read)."""
    def run_waves(host_cache_pages: int):
        core, runner = make_core(num_pages=num_pages, host_cache_pages=host_cache_pages, page_bytes=PAGE_BYTES,
                                 max_concurrency=3, max_model_len=48)
        collected = Collected()
        for w, wave in enumerate(waves):
            for i, (seed, length) in enumerate(wave):
                core.add_request(prompt_request(f"w{w}r{i}", tokens(length, seed), max_tokens=3))
            run_until_idle(core, collected)
            assert_idle(core)
        return core, collected

    on, collected_on = run_waves(host_pages)
    _, collected_off = run_waves(0)
    assert collected_on.tokens == collected_off.tokens
    m = on.metrics()
    assert m.host_reused_tokens <= m.reused_tokens and m.host_memory_records <= host_pages
    assert m.host_reused_tokens == PAGE * m.host_bytes_in // PAGE_BYTES
