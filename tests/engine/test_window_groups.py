"""Sliding-window page groups (helios/engine/kv_groups.py): the window layers' own pool and tables, pages before
the window returned, the memory bound, prefix reuse, preemption and aborts, with the fake runner checking every
chunk's window KV in the group's own pages (and that no returned page is read)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.config import SchedulerConfig
from helios.engine.kv_groups import NULL_PAGE, WindowGroup, window_pages_per_request
from helios.engine.messages import EngineRequest, SamplingParams
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import Collected, make_core, page_owners, request, run_until_idle, window_page_owners

PAGE, WINDOW = 4, 10  # a window that is not a multiple of the page


def window_core(**config):
    """make_core with a window group of WINDOW tokens (roomy unless told)."""
    defaults = dict(sliding_window=WINDOW, window_pages=64)
    return make_core(**{**defaults, **config})


def reference(req: EngineRequest, **config) -> list[int]:
    """The request's tokens on a one-group engine (the fake model reads tokens, not pages)."""
    core, _ = make_core(num_pages=4096, **config)
    core.add_request(req)
    return run_until_idle(core).tokens[req.req_id]


def window_bound(window: int = WINDOW, page: int = PAGE) -> int:
    """Pages of the window group one request holds between steps: its next query at n reads n - W + 1 .. n, and a
    decode may hold the look-ahead page of n + 1 when n ends a page: W (+1) positions, ceil(W / P) + 1 pages."""
    return -(-window // page) + 1


def assert_idle(core) -> None:
    for pool in core.scheduler.pools:
        pool.check_invariants()
        assert pool.num_free_blocks == pool.num_blocks
    assert not core.scheduler.requests


def step_checked(core, collected: Collected, bound: int | None = None) -> None:
    collected.add(core.step())
    page_owners(core.scheduler)  # both groups' invariants
    if bound is not None:
        assert core.scheduler.window_groups[0].pool.num_used_blocks <= bound


# --- the group's rule ---------------------------------------------------------------------------


def test_release_returns_the_pages_wholly_before_the_next_querys_window():
    group = WindowGroup(sliding_window=WINDOW, num_pages=16, page_size=PAGE)
    table = group.pool.allocate(6)  # positions 0 .. 23
    # the next query at 13 sees 4 .. 13: page 0 (0..3) is out, page 1 (4..7) is still read
    group.release_before_window(table, 13)
    assert table[0] == NULL_PAGE and table[1] != NULL_PAGE and group.pool.num_used_blocks == 5
    group.release_before_window(table, 16)  # sees 7 .. 16: page 1 still read
    assert group.num_held(table) == 5
    group.release_before_window(table, 18)  # sees 9 .. 18: pages 0, 1 out
    assert table[:2] == [NULL_PAGE] * 2 and group.num_held(table) == 4
    group.release_before_window(table, 5)  # never grows back
    assert group.num_held(table) == 4
    group.release(table)
    assert group.pool.num_free_blocks == 16
    group.pool.check_invariants()


def test_config_sets_window_and_pages_together_and_fits_one_request():
    with pytest.raises(ValueError, match="together"):
        SchedulerConfig(sliding_window=8)
    needed = window_pages_per_request(WINDOW, PAGE, 16)
    assert needed == -(-(WINDOW + 16) // PAGE) + 1
    with pytest.raises(ValueError, match="window_pages"):
        SchedulerConfig(page_size=PAGE, prefill_chunk_size=16, sliding_window=WINDOW, window_pages=needed - 1)
    SchedulerConfig(page_size=PAGE, prefill_chunk_size=16, sliding_window=WINDOW, window_pages=needed)
    with pytest.raises(ValueError, match="host tiers"):
        SchedulerConfig(page_size=PAGE, prefill_chunk_size=16, sliding_window=WINDOW, window_pages=64,
                        host_cache_pages=8)


# --- the memory bound ---------------------------------------------------------------------------


@pytest.mark.parametrize("window, chunk", [(WINDOW, 16), (8, 16), (3, 5), (40, 7), (1, 16)])
def test_a_long_prompt_holds_no_more_window_pages_than_the_window_needs(window, chunk):
    """Asserted from the pool's counters after every step (and inside each plan, from its tables): a 400-token
    prompt and 60 decodes hold at most ceil(W / P) + 1 window pages between steps, whatever the group 0 pages."""
    config = dict(sliding_window=window, prefill_chunk_size=chunk, max_num_batched_tokens=64, num_pages=200)
    core, runner = window_core(**config)
    req = request("long", prompt_len=400, max_tokens=60, ignore_eos=True)
    core.add_request(req)
    group, collected = core.scheduler.window_groups[0], Collected()
    bound, peak, peak_full = window_bound(window), 0, 0
    while core.has_unfinished_requests():
        step_checked(core, collected, bound)
        peak = max(peak, group.pool.num_used_blocks)
        peak_full = max(peak_full, core.scheduler.block_pool.num_used_blocks)
        plan = runner.plans[-1]
        if plan.scheduled:  # inside a step: the window and the chunk
            held = sum(b >= 0 for b in plan.scheduled[0].group_block_ids[0])
            assert held <= window_pages_per_request(window, PAGE, chunk)
    assert collected.tokens["long"] == reference(req, prefill_chunk_size=chunk)
    assert peak <= bound and peak_full == -(-(400 + 60) // PAGE)  # group 0 keeps every page
    assert_idle(core)


def test_metrics_sum_the_groups_pools():
    core, _ = window_core(num_pages=50, window_pages=20)
    core.add_request(request("a", prompt_len=40, max_tokens=2))
    core.step()
    m = core.metrics()
    pools = core.scheduler.pools
    assert m.total_pages == 70 and m.free_pages == sum(p.num_free_blocks for p in pools)
    run_until_idle(core)
    assert core.metrics().free_pages == 70 and core.metrics().cached_pages == sum(p.num_cached_blocks for p in pools)


# --- correctness under the scheduler's paths ----------------------------------------------------


def test_batched_requests_give_their_tokens_alone():
    core, _ = window_core(max_concurrency=4, prefill_chunk_size=8, max_num_batched_tokens=20)
    reqs = [request(f"r{i}", prompt_len=30 + 9 * i, max_tokens=12, seed=i, ignore_eos=True) for i in range(6)]
    for r in reqs:
        core.add_request(r)
    collected = Collected()
    while core.has_unfinished_requests():
        step_checked(core, collected, bound=4 * window_bound())
    for r in reqs:
        assert collected.tokens[r.req_id] == reference(r, prefill_chunk_size=8)
    assert_idle(core)


@pytest.mark.parametrize("scarce", ["full", "window"])
def test_preemption_by_either_pool_recomputes_the_same_tokens(scarce):
    """Four long requests over a pool that cannot hold them all: the group that runs out (group 0's pages, or the
    window group at its one-request minimum) preempts the youngest, which recomputes to the same tokens."""
    minimum = window_pages_per_request(WINDOW, PAGE, 8)
    pools = dict(num_pages=24, window_pages=64) if scarce == "full" else dict(num_pages=400, window_pages=minimum)
    core, runner = window_core(max_concurrency=4, prefill_chunk_size=8, max_num_batched_tokens=32, **pools)
    reqs = [request(f"r{i}", prompt_len=20 + 3 * i, max_tokens=30, seed=i, ignore_eos=True) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    collected = Collected()
    while core.has_unfinished_requests():
        step_checked(core, collected)
    assert core.scheduler.num_preemptions > 0
    assert max(runner.num_new.values()) > 1
    for r in reqs:
        assert collected.tokens[r.req_id] == reference(r, prefill_chunk_size=8)
    assert_idle(core)


@pytest.mark.parametrize("state", ["mid_prefill", "decoding", "between_schedule_and_update"])
def test_abort_returns_both_groups_pages(state):
    core, runner = window_core(max_concurrency=2, prefill_chunk_size=8, max_num_batched_tokens=16)
    core.add_request(request("x", prompt_len=60, max_tokens=40))
    core.add_request(request("y", prompt_len=9, max_tokens=5))
    for _ in range(3 if state == "mid_prefill" else 12):
        core.step()
    if state == "between_schedule_and_update":
        plan = core.scheduler.schedule()
        core.abort("x")
        core.scheduler.update(plan, runner.execute(plan))
    else:
        core.abort("x")
    window_page_owners(core.scheduler)
    run_until_idle(core)
    assert_idle(core)


# --- prefix reuse -------------------------------------------------------------------------------


def prompt_request(req_id: str, prompt: list[int], **sampling) -> EngineRequest:
    return EngineRequest(req_id=req_id, prompt_token_ids=list(prompt),
                         sampling=SamplingParams(**{"max_tokens": 6, **sampling}))


def first_chunk(runner, req_id: str):
    for plan in runner.plans:
        for s in plan.scheduled:
            if s.req_id == req_id:
                return s
    raise AssertionError(req_id)


def test_a_repeated_prompt_reuses_the_full_pages_and_the_windows_pages():
    prompt = list(range(100, 141))  # 41 tokens: a hit of (41 - 1) // 4 = 10 pages
    core, runner = window_core(prefill_chunk_size=8, max_num_batched_tokens=16)
    core.add_request(prompt_request("a", prompt))
    first = run_until_idle(core)
    core.add_request(prompt_request("b", prompt))
    second = run_until_idle(core)
    assert second.final["b"].num_cached_tokens == 40 and second.tokens["b"] == first.tokens["a"]
    chunk = first_chunk(runner, "b")
    table = chunk.group_block_ids[0]
    # the hit's window: the query at 40 reads 31 .. 40, pages 7 .. 9 of the hit (and the fresh page 10)
    assert table[:7] == [NULL_PAGE] * 7 and all(b >= 0 for b in table[7:])
    assert all(b >= 0 for b in chunk.block_ids)
    assert_idle(core)


def test_a_hit_whose_window_pages_were_evicted_is_cut_back():
    """Group 0 still holds a's pages (cached, free), but the window group's small pool gave a's window pages to
    another request: b reuses only as far back as the window group has the window's pages, and its tokens match."""
    prompt = list(range(200, 241))
    minimum = window_pages_per_request(WINDOW, PAGE, 8)
    core, _ = window_core(num_pages=400, window_pages=minimum, prefill_chunk_size=8, max_num_batched_tokens=16)
    core.add_request(prompt_request("a", prompt))
    run_until_idle(core)
    core.add_request(request("other", prompt_len=80, max_tokens=2))  # cycles the window pool's every page
    run_until_idle(core)
    core.add_request(prompt_request("b", prompt))
    got = run_until_idle(core)
    assert got.final["b"].num_cached_tokens < 40
    assert got.tokens["b"] == reference(prompt_request("b", prompt), prefill_chunk_size=8)
    assert_idle(core)


def test_match_windows_takes_the_longest_hit_whose_window_is_cached():
    """Unit view of PrefixCache.match_windows: the window group lacks one page; hits whose window needs it are cut."""
    core, _ = window_core(num_pages=64, window_pages=64, prefill_chunk_size=8, max_num_batched_tokens=16)
    sched = core.scheduler
    prompt = list(range(300, 341))
    core.add_request(prompt_request("a", prompt))
    run_until_idle(core)
    group = sched.window_groups[0]
    core.add_request(prompt_request("x", prompt))
    req = sched.waiting[0]
    hits = sched.prefix_cache.match(req)
    assert len(hits) == 10
    # drop the window group's page 8 from the cache: hits of 9 .. 10 pages read it (their windows start at page 6
    # and 7), a hit of 8 pages (query at 32 sees 23 .. 32: pages 5 .. 7) does not
    page8 = group.pool.cached_block(req.page_hashes[8])
    group.pool.uncache_block(page8)
    num_hits, tables = sched.prefix_cache.match_windows(req, len(hits))
    assert num_hits == 8
    assert tables[0][:5] == [NULL_PAGE] * 5 and all(b >= 0 for b in tables[0][5:8]) and len(tables[0]) == 8
    got = run_until_idle(core)
    assert got.final["x"].num_cached_tokens == 32
    assert_idle(core)


# --- property test ------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 60), st.integers(0, 12), st.integers(0, 3)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(_op, max_size=60),
    num_pages=st.integers(4, 30),
    extra_window_pages=st.integers(0, 12),
    window=st.integers(1, 14),
    concurrency=st.integers(1, 5),
    chunk=st.integers(1, 12),
    prefix_caching=st.booleans(),
)
def test_random_add_abort_step_keep_both_pools_invariants(ops, num_pages, extra_window_pages, window, concurrency,
                                                          chunk, prefix_caching):
    """Random adds (prompts drawn from 4 families, so prefixes repeat), aborts and steps over two small pools:
    after every operation both pools' counts match the live tables exactly, no table names a page before its
    window (the fake runner), every finished request got its tokens alone, and the idle engine has every page."""
    window_pages = window_pages_per_request(window, PAGE, chunk) + extra_window_pages
    config = dict(num_pages=num_pages, window_pages=window_pages, sliding_window=window, max_concurrency=concurrency,
                  prefill_chunk_size=chunk, max_num_batched_tokens=max(concurrency, 10), max_waiting=8,
                  max_model_len=64, enable_prefix_caching=prefix_caching)
    core, runner = make_core(**config)
    sched = core.scheduler
    collected = Collected()
    added: dict[str, EngineRequest] = {}
    aborted: set[str] = set()

    def check():
        page_owners(sched)
        for req in sched.running:  # between steps: no more window pages than the window needs
            held = sum(b >= 0 for b in req.group_block_ids[0])
            assert held <= window_bound(window), (req, req.group_block_ids[0])

    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            prompt = [10 + (op[3] * 37 + i * 11) % 300 for i in range(op[1])]
            req = prompt_request(rid, prompt, max_tokens=op[2], ignore_eos=True)
            try:
                core.add_request(req)
                added[rid] = req
            except (QueueFull, ValueError):
                pass
        elif op[0] == "abort" and added:
            rid = list(added)[op[1] % len(added)]
            if core.abort(rid) is not None:
                aborted.add(rid)
        elif op[0] == "step":
            for _ in range(op[1]):
                collected.add(core.step())
        check()
    run_until_idle(core, collected)
    check()
    assert_idle(core)
    for rid, req in added.items():
        out = collected.final.get(rid)
        if rid in aborted or out is None or out.finish_reason != "length" or req.sampling.max_tokens == 0:
            continue
        if len(collected.tokens[rid]) == req.sampling.max_tokens:
            assert collected.tokens[rid] == reference(req, prefill_chunk_size=chunk, max_model_len=64)
