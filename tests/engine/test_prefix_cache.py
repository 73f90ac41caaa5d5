"""Prefix caching: chained page hashes, the pool's hash <-> page map and eviction, and the scheduler's reuse
at admission (hit cap, sharing, prompt logprobs, preemption, the switch), with the fake runner's simulated
paged KV checking that every reused page holds exactly the request's tokens and no shared page is written."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.block_pool import BlockPool
from helios.engine.messages import EngineRequest, SamplingParams
from helios.engine.prefix_cache import ROOT_HASH, extend_page_hashes, hash_page
from helios.engine.request import RequestStatus
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import Collected, make_core, page_owners, reference_tokens, run_until_idle

PAGE = 4  # make_core's page size


def prompt_request(req_id: str, prompt: list[int], **sampling) -> EngineRequest:
    return EngineRequest(req_id=req_id, prompt_token_ids=list(prompt), sampling=SamplingParams(**sampling))


def tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def first_chunk(runner, req_id: str, admission: int = 1):
    """The ScheduledRequest of `req_id`'s first step after its n-th admission (sent as new)."""
    seen = 0
    for plan in runner.plans:
        if any(n.req_id == req_id for n in plan.new_requests):
            seen += 1
            if seen == admission:
                return next(s for s in plan.scheduled if s.req_id == req_id)
    raise AssertionError(f"{req_id} was admitted fewer than {admission} times")


def assert_idle(core) -> None:
    pool = core.scheduler.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks
    assert not core.scheduler.requests


# --- hashing ------------------------------------------------------------------------------------


def test_page_hashes_chain_and_extend_incrementally():
    ids = tokens(11)
    hashes: list[bytes] = []
    extend_page_hashes(hashes, ids, PAGE, 2)
    assert hashes == [hash_page(ROOT_HASH, ids[:4]), hash_page(hash_page(ROOT_HASH, ids[:4]), ids[4:8])]
    extend_page_hashes(hashes, ids, PAGE, 2)  # nothing to add
    assert len(hashes) == 2
    with pytest.raises(AssertionError):
        extend_page_hashes(hashes, ids, PAGE, 3)  # only 2 full pages in 11 tokens
    # equal pages under different parents differ: a hash names the whole prefix, not the page alone
    a, b = [], []
    extend_page_hashes(a, [1, 2, 3, 4, 9, 9, 9, 9], PAGE, 2)
    extend_page_hashes(b, [5, 6, 7, 8, 9, 9, 9, 9], PAGE, 2)
    assert a[1] != b[1]
    assert hash_page(ROOT_HASH, [1, 2, 3, 4]) == hash_page(ROOT_HASH, (1, 2, 3, 4)) and len(a[0]) == 32


# --- the pool -----------------------------------------------------------------------------------


def test_a_reallocated_cached_page_is_evicted():
    pool = BlockPool(3, PAGE)
    pages = pool.allocate(3)
    for page, h in zip(pages, (b"a", b"b", b"c")):
        pool.cache_block(page, h)
    pool.free(pages)  # all free and cached: evictable
    assert (pool.num_free_blocks, pool.num_cached_blocks) == (3, 3)
    assert pool.find_cached_prefix([b"a", b"b", b"c"]) == pages
    (got,) = pool.allocate(1)
    assert got == pages[0]  # least recently freed first
    assert pool.block_hash(got) is None and pool.num_cached_blocks == 2
    assert pool.find_cached_prefix([b"a", b"b"]) == []  # the chain is broken at its first page
    pool.check_invariants()


def test_a_hit_on_a_free_cached_page_takes_it_off_the_free_list():
    pool = BlockPool(4, PAGE)
    pages = pool.allocate(4)
    pool.cache_block(pages[1], b"x")
    pool.free(pages)
    assert pool.num_free_among([pages[1]]) == 1
    pool.incref([pages[1]])
    assert pool.ref_count(pages[1]) == 1 and pool.num_free_blocks == 3
    pool.check_invariants()
    with pytest.raises(ValueError, match="incref of free"):
        pool.incref([pages[0]])  # a free page without a hash can never be shared
    assert pages[1] not in pool.allocate(3)  # it is no longer on the free list
    pool.free(pages)  # everything back; the cached page keeps its hash
    assert pool.block_hash(pages[1]) == b"x"
    pool.check_invariants()


def test_cache_block_keeps_the_first_mapping():
    pool = BlockPool(4, PAGE)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"h")
    pool.cache_block(b, b"h")  # the hash already names a page: kept, no dedup
    pool.cache_block(a, b"other")  # a page keeps its first hash
    assert pool.find_cached_prefix([b"h"]) == [a] and pool.block_hash(b) is None
    assert pool.block_hash(a) == b"h" and pool.num_cached_blocks == 1
    with pytest.raises(ValueError, match="cache_block of free"):
        pool.cache_block(pool.num_blocks - 1, b"z")
    pool.check_invariants()


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "hit"]), st.integers(0, 50)), max_size=80))
def test_random_pool_operations_keep_invariants(ops):
    pool = BlockPool(8, PAGE)
    held: list[int] = []  # one entry per reference held
    for op, n in ops:
        if op == "alloc":
            k = n % 4
            if pool.can_allocate(k):
                held += pool.allocate(k)
        elif op == "free" and held:
            pool.free([held.pop(n % len(held))])
        elif op == "cache" and held:
            pool.cache_block(held[n % len(held)], bytes([n % 6]))
        elif op == "hit":
            found = pool.find_cached_prefix([bytes([n % 6])])
            free_before = pool.num_free_blocks
            pool.incref(found)
            assert pool.num_free_blocks == free_before - sum(pool.ref_count(b) == 1 for b in found)
            held += found
        pool.check_invariants()
        for block_id in range(pool.num_blocks):
            assert pool.ref_count(block_id) == held.count(block_id)
    pool.free(held)
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


# --- the scheduler ------------------------------------------------------------------------------


@pytest.mark.parametrize(("prompt_len", "num_reused"), [(16, 12), (17, 16), (18, 16), (3, 0), (4, 0), (5, 4)])
def test_reuse_is_capped_so_one_token_is_computed(prompt_len, num_reused):
    core, runner = make_core()
    prompt = tokens(prompt_len)
    core.add_request(prompt_request("a", prompt, max_tokens=3))
    first = run_until_idle(core)
    core.add_request(prompt_request("b", prompt, max_tokens=3))
    second = run_until_idle(core)
    assert second.tokens["b"] == first.tokens["a"]
    chunk = first_chunk(runner, "b")
    assert chunk.num_computed_tokens == num_reused and chunk.token_ids == prompt[num_reused:]
    assert chunk.block_ids[: num_reused // PAGE] == first_chunk(runner, "a").block_ids[: num_reused // PAGE]
    assert {o.num_cached_tokens for o in second.outputs["b"]} == {num_reused}
    assert {o.num_cached_tokens for o in first.outputs["a"]} == {0}
    m = core.metrics()
    assert m.reused_tokens == num_reused
    assert m.prefill_tokens == 2 * prompt_len - num_reused
    assert_idle(core)


def test_two_sharers_hold_one_reference_each():
    core, runner = make_core()
    prompt = tokens(13)
    core.add_request(prompt_request("a", prompt, max_tokens=20))
    got = Collected()
    got.add(core.step())  # a's whole prompt: pages 0..2 are full and published
    core.add_request(prompt_request("b", prompt, max_tokens=2))
    got.add(core.step())
    sched, pool = core.scheduler, core.scheduler.block_pool
    a, b = sched.requests["a"], sched.requests["b"]
    shared = a.block_ids[:3]
    assert b.block_ids[:3] == shared and b.block_ids[3] != a.block_ids[3]
    assert [pool.ref_count(x) for x in shared] == [2, 2, 2]
    while "b" in sched.requests:
        got.add(core.step())
    assert [pool.ref_count(x) for x in shared] == [1, 1, 1]  # b let go; a still holds them
    run_until_idle(core, got)
    assert got.tokens["b"] == reference_tokens(prompt_request("b", prompt, max_tokens=2))
    assert got.tokens["a"] == reference_tokens(prompt_request("a", prompt, max_tokens=20))
    assert all(pool.block_hash(x) is not None for x in shared)  # free, still cached
    assert_idle(core)


def test_prompt_logprobs_requests_do_not_reuse_but_publish():
    core, runner = make_core()
    prompt = tokens(14)
    core.add_request(prompt_request("a", prompt, max_tokens=2))
    run_until_idle(core)
    core.add_request(prompt_request("p", prompt, max_tokens=2, prompt_logprobs=1))
    got = run_until_idle(core)
    assert first_chunk(runner, "p").num_computed_tokens == 0
    assert got.final["p"].num_cached_tokens == 0
    records = [o for o in got.outputs["p"] if o.prompt_logprobs is not None]
    assert [r.token.token_id for r in records[0].prompt_logprobs] == prompt[1:]

    # a scoring request alone still publishes its pages for others
    core, runner = make_core()
    core.add_request(prompt_request("p", prompt, max_tokens=0, prompt_logprobs=0))
    run_until_idle(core)
    assert core.metrics().cached_pages == 3
    core.add_request(prompt_request("b", prompt, max_tokens=2))
    got = run_until_idle(core)
    assert got.final["b"].num_cached_tokens == 12
    assert got.tokens["b"] == reference_tokens(prompt_request("b", prompt, max_tokens=2))


def test_a_preempted_request_resumes_from_its_cached_pages():
    core, runner = make_core()
    prompt = tokens(10)
    req = prompt_request("a", prompt, max_tokens=12)
    core.add_request(req)
    got = Collected()
    sched = core.scheduler
    while sched.requests["a"].num_output_tokens < 6:
        got.add(core.step())
    a = sched.requests["a"]
    computed = a.num_computed_tokens  # 15: prompt + 5 of the 6 outputs
    sched.running.remove(a)
    sched._preempt(a)
    run_until_idle(core, got)
    assert got.tokens["a"] == reference_tokens(req)
    resumed = first_chunk(runner, "a", admission=2)
    assert resumed.num_computed_tokens == computed // PAGE * PAGE == 12  # prompt and output pages alike
    assert resumed.token_ids == (prompt + got.tokens["a"])[12:16]
    assert {o.num_cached_tokens for o in got.outputs["a"]} == {0}  # usage: reuse at the first admission only
    m = core.metrics()
    assert (m.reused_tokens, m.prefill_tokens, m.preemptions) == (12, 10, 1)
    assert_idle(core)


def test_evicted_pages_are_recomputed():
    # 8 pages: b's prompt needs all of them, which evicts a's cached pages
    core, runner = make_core(num_pages=8)
    prompt_a, prompt_b = tokens(13, seed=1), tokens(30, seed=2)
    req_a = prompt_request("a", prompt_a, max_tokens=2)
    core.add_request(req_a)
    run_until_idle(core)
    core.add_request(prompt_request("b", prompt_b, max_tokens=2))
    run_until_idle(core)
    core.add_request(prompt_request("a2", prompt_a, max_tokens=2))
    got = run_until_idle(core)
    assert first_chunk(runner, "a2").num_computed_tokens == 0
    assert got.tokens["a2"] == reference_tokens(req_a)
    assert_idle(core)


def test_a_diverging_prompt_reuses_only_the_common_full_pages():
    core, runner = make_core()
    base = tokens(20)
    other = base[:10] + tokens(10, seed=9)  # diverges inside page 2
    core.add_request(prompt_request("a", base, max_tokens=4))
    run_until_idle(core)
    req = prompt_request("b", other, max_tokens=4)
    core.add_request(req)
    got = run_until_idle(core)
    assert first_chunk(runner, "b").num_computed_tokens == 8
    assert got.tokens["b"] == reference_tokens(req)


def test_disabled_prefix_caching_reuses_nothing():
    core, runner = make_core(enable_prefix_caching=False)
    prompt = tokens(17)
    for rid in ("a", "b"):
        core.add_request(prompt_request(rid, prompt, max_tokens=3))
        got = run_until_idle(core)
        assert got.final[rid].num_cached_tokens == 0 and first_chunk(runner, rid).num_computed_tokens == 0
    m = core.metrics()
    assert (m.reused_tokens, m.cached_pages, m.prefill_tokens) == (0, 0, 34)
    assert core.scheduler.prefix_cache is None


def test_hits_on_free_pages_count_against_the_free_list():
    # 8 pages. a leaves 5 cached free pages; c then holds 2 pages, so 6 are free. b would reuse a's 5 and
    # needs 2 fresh ones: 7 > 6 free (taking the hits empties the free list), so b waits for c
    core, runner = make_core(num_pages=8, max_model_len=32)
    prompt = tokens(20)
    core.add_request(prompt_request("a", prompt, max_tokens=1))
    run_until_idle(core)
    core.add_request(prompt_request("c", tokens(5, seed=3), max_tokens=3))
    got = Collected()
    got.add(core.step())
    req = prompt_request("b", prompt + tokens(6, seed=5), max_tokens=1)
    core.add_request(req)
    while "c" in core.scheduler.requests:
        assert core.scheduler.requests["b"].status is RequestStatus.WAITING
        got.add(core.step())
    run_until_idle(core, got)
    assert first_chunk(runner, "b").num_computed_tokens == 20
    assert got.tokens["b"] == reference_tokens(req)
    assert_idle(core)


# --- property test: shared prefixes under pressure ----------------------------------------------

_PREFIXES = [tokens(24, seed=100 + i) for i in range(3)]
_op = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 24), st.integers(1, 12), st.integers(0, 8)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=50), num_pages=st.integers(6, 24), concurrency=st.integers(1, 4),
       chunk=st.integers(1, 12))
def test_random_shared_prefix_workloads_keep_invariants_and_tokens(ops, num_pages, concurrency, chunk):
    config = dict(num_pages=num_pages, max_concurrency=concurrency, prefill_chunk_size=chunk,
                  max_num_batched_tokens=max(concurrency, 10), max_waiting=8, max_model_len=48)
    core, runner = make_core(**config)
    sched, pool = core.scheduler, core.scheduler.block_pool
    collected = Collected()
    added: dict[str, EngineRequest] = {}
    aborted: set[str] = set()

    def check():
        owners = page_owners(sched)
        assert all(pool.ref_count(b) == n for b, n in owners.items()), "reference counts differ from owners"

    for op in ops:
        if op[0] == "add":
            _, family, cut, tail, max_tokens = op
            rid = f"r{len(added)}"
            req = prompt_request(rid, _PREFIXES[family][:cut] + tokens(tail, seed=len(added)), max_tokens=max_tokens)
            try:
                core.add_request(req)
                added[rid] = req
            except (QueueFull, ValueError):
                pass
        elif op[0] == "abort" and added:
            rid = list(added)[op[1] % len(added)]
            if core.abort(rid) is not None:
                aborted.add(rid)
        else:
            for _ in range(op[1]):
                collected.add(core.step())
        check()
    run_until_idle(core, collected)
    check()
    assert_idle(core)
    roomy = dict(config, enable_prefix_caching=False)
    for rid, req in added.items():
        if rid in aborted or collected.final[rid].finish_reason != "length" or len(collected.tokens[rid]) != (
            req.sampling.max_tokens
        ):
            continue  # cut short (abort, or the small pool's length limit)
        assert collected.tokens[rid] == reference_tokens(req, **roomy), rid
