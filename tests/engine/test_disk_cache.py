"""The host tier's disk records with the fake runner (its `disk` dict stands for the record directory): DRAM
records whose slots are reused are spilled to disk, come back at admission through a DRAM slot, survive a restart
(the index is seeded from the directory) and are dropped least recently used first. The fake runner checks every
read, so a record loaded from the wrong file or a slot overwritten in the wrong order fails here."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.engine_core import RequestExecutionError
from helios.engine.host_cache import HostCache
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import Collected, make_core, page_owners, reference_tokens, run_until_idle
from tests.engine.test_host_cache import (PAGE, PAGE_BYTES, assert_idle, first_chunk, prompt_request, run_one,
                                          tokens)

# 12 GPU pages, 8 DRAM records (A's 7 reusable pages fit, but the other prompts push them out), 64 disk records
TIERS = dict(num_pages=12, host_cache_pages=8, host_disk_pages=64, page_bytes=PAGE_BYTES)
A = tokens(30, seed=1)


def evict_to_disk_and_repeat(fail=None, **config) -> tuple:
    core, runner = make_core(fail=fail, **{**TIERS, **config})
    collected = Collected()
    run_one(core, prompt_request("a1", A), collected)
    for i in range(3):
        run_one(core, prompt_request(f"other{i}", tokens(30, seed=10 + i)), collected)
    return core, runner, collected


def assert_index_is_the_directory(core, runner) -> None:
    host = core.scheduler.host_cache
    assert set(host._disk) == set(runner.disk) and core.metrics().host_disk_records == len(runner.disk)


def test_records_evicted_from_dram_spill_to_disk_and_come_back():
    core, runner, collected = evict_to_disk_and_repeat()
    assert runner.num_spilled > 0 and core.metrics().host_disk_records == runner.num_spilled
    assert not core.scheduler.host_cache.find_prefix(_hashes(A)[:1])  # A's head left DRAM
    run_one(core, prompt_request("a2", A), collected)
    plan, chunk = first_chunk(runner, "a2")
    assert chunk.num_computed_tokens == 28 and len(plan.copy_in) == 7 and len(plan.load) >= 1
    assert {s for _, s in plan.load} <= {s for s, _ in plan.copy_in}
    assert collected.final["a2"].num_cached_tokens == 28
    assert collected.tokens["a2"] == collected.tokens["a1"] == reference_tokens(prompt_request("a", A))
    assert core.metrics().host_reused_tokens == 28
    assert_index_is_the_directory(core, runner)
    assert_idle(core)

    # the same traffic without the disk tier: A's head is gone
    core, runner, collected = evict_to_disk_and_repeat(host_disk_pages=0)
    run_one(core, prompt_request("a2", A), collected)
    assert collected.final["a2"].num_cached_tokens < 28 and runner.num_spilled == 0
    assert core.metrics().host_disk_records == 0 and collected.tokens["a2"] == collected.tokens["a1"]


def test_a_restarted_engine_serves_from_the_records_it_finds():
    core, runner, collected = evict_to_disk_and_repeat()
    disk = dict(runner.disk)  # the directory, least recently written first (dicts keep insertion order)
    core, runner = make_core(disk=disk, **TIERS)
    assert core.metrics().host_disk_records == len(disk)
    collected = Collected()
    run_one(core, prompt_request("a2", A), collected)
    plan, chunk = first_chunk(runner, "a2")
    num_disk = sum(h in disk for h in _hashes(A))
    assert num_disk >= 1 and chunk.num_computed_tokens == num_disk * PAGE and len(plan.load) == num_disk
    assert collected.tokens["a2"] == reference_tokens(prompt_request("a", A))
    assert_idle(core)


def test_a_small_disk_drops_its_least_recently_used_records():
    core, runner, collected = evict_to_disk_and_repeat(host_disk_pages=5)
    assert any(p.disk_drop for p in runner.plans) and len(runner.disk) == 5
    assert_index_is_the_directory(core, runner)
    run_one(core, prompt_request("a2", A), collected)  # A's head was dropped first: no reuse from disk
    plan, _ = first_chunk(runner, "a2")
    assert not plan.load and collected.tokens["a2"] == collected.tokens["a1"]
    assert_idle(core)


def test_a_failed_plan_forgets_the_records_it_loaded():
    def fail(plan):
        return RequestExecutionError([s.req_id for s in plan.scheduled], "injected") if plan.load else None

    core, runner, collected = evict_to_disk_and_repeat(fail=fail)
    run_one(core, prompt_request("a2", A), collected)
    failed, _ = first_chunk(runner, "a2")
    assert collected.final["a2"].finish_reason == "error" and failed.load
    host = core.scheduler.host_cache
    assert not {h for h, _ in failed.load} & set(host._disk)  # forgotten in DRAM and on disk, files deleted later
    assert not {s for _, s in failed.load} & set(host.find_prefix(_hashes(A)))
    runner.fail = None
    run_one(core, prompt_request("a3", A), collected)
    assert collected.tokens["a3"] == collected.tokens["a1"] and core.is_healthy
    assert_index_is_the_directory(core, runner)
    assert_idle(core)


def test_a_missing_record_is_recomputed_not_served():
    """The runner cannot read a record (its file is gone): the step fails naming no request, the engine forgets
    the records and the request runs again from scratch with the same tokens."""
    core, runner, collected = evict_to_disk_and_repeat()
    runner.disk.clear()
    run_one(core, prompt_request("a2", A), collected)
    failed, _ = first_chunk(runner, "a2")
    assert failed.load and runner.num_new["a2"] == 2 and collected.final["a2"].finish_reason != "error"
    assert collected.tokens["a2"] == collected.tokens["a1"] and core.is_healthy
    # the records it tried are forgotten (unless spilled again since, from the recomputed pages)
    assert {h for h, _ in failed.load} & set(core.scheduler.host_cache._disk) <= set(runner.disk)
    assert_idle(core)


def test_spill_drop_and_pins():
    host = HostCache(2, page_bytes=1, num_disk_records=2)
    h = [bytes([i]) * 32 for i in range(6)]
    assert [host.store(x) for x in h[:2]] == [0, 1]
    host.end_step()
    assert host.take_disk_ops() == ([], [], [])
    assert host.store(h[2]) == 0 and host.store(h[3]) == 1  # both records spill
    host.end_step()
    assert host.take_disk_ops() == ([(0, h[0]), (1, h[1])], [], [])
    # h[0] and h[1] on disk, h[2] and h[3] in DRAM: a run through both tiers loads the disk records
    assert host.find_tiered_prefix([h[2], h[0], h[1]]) == [0, None]  # two slots, one is h[2]'s: one load fits
    assert host.find_tiered_prefix([h[0], h[3]]) == [None, 1] and host.take([h[0], h[3]], 8, [None, 1]) == [0, 1]
    spill, drop, load = host.take_disk_ops()
    # h[2]'s slot is taken (spilled, which drops disk's least recently used record, h[1]: h[0] is pinned)
    assert (spill, drop, load) == ([(0, h[2])], [h[1]], [(h[0], 0)])
    assert host.store(h[4]) is None  # every slot pinned
    host.end_step()
    assert host.find_prefix([h[0], h[3]]) == [0, 1] and host.num_disk_records == 2
    host.check_invariants()
    # a failed plan's drop is sent again, but a later spill of that record cancels it (the runner deletes after
    # it writes, so the drop would win)
    host.forget_disk_ops([], [h[5]], [])  # a failed plan dropped h[5]: sent again
    assert host.store(h[5]) == 1 and host.take_disk_ops() == ([(1, h[3])], [h[5], h[0]], [])
    host.end_step()
    host.forget_disk_ops([], [h[5]], [])  # that plan failed too
    assert host.store(h[1]) == 0 and host.store(h[4]) == 1  # h[0] and h[5] spill, dropping h[2] and h[3]
    host.end_step()
    assert host.take_disk_ops() == ([(0, h[0]), (1, h[5])], [h[2], h[3]], [])
    host.check_invariants()


def test_seed_disk_keeps_the_most_recent_records():
    host = HostCache(2, page_bytes=1, num_disk_records=2)
    h = [bytes([i]) * 32 for i in range(3)]
    host.seed_disk(h)
    assert host.num_disk_records == 2 and host.take_disk_ops() == ([], [h[0]], [])
    assert host.find_tiered_prefix(h[1:]) == [None, None]
    off = HostCache(2, page_bytes=1)
    off.seed_disk(h)
    assert off.num_disk_records == 0 and off.take_disk_ops()[1] == h


def _hashes(prompt: list[int]) -> list[bytes]:
    from tests.engine.test_host_cache import _page_hashes

    return _page_hashes(prompt)


# --- property test ------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    waves=st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(5, 40)), min_size=1, max_size=3),
                   min_size=2, max_size=10),
    num_pages=st.integers(11, 24),
    host_pages=st.integers(1, 12),
    disk_pages=st.integers(1, 40),
    fail_every=st.integers(0, 5),
    restart_after=st.integers(0, 10),
)
def test_random_waves_with_the_disk_tier_give_the_tokens_of_the_tiers_off(waves, num_pages, host_pages, disk_pages,
                                                                         fail_every, restart_after):
    """Waves of prompts from four shared heads, each run to idle, some plans failing before the runner copies
    (their requests are recomputed) and the engine restarted on its records once: every request gives the tokens
    it gives with no tier, and the disk index is the directory."""
    count = [0, 0]  # plans, failures

    def fail(plan):
        count[0] += 1
        if fail_every and count[0] % fail_every == 0 and count[1] < 4 and (plan.spill or plan.load or plan.disk_drop):
            count[1] += 1
            return RequestExecutionError(set(), "injected")
        return None

    def run_waves(host_cache_pages: int, host_disk_pages: int):
        config = dict(num_pages=num_pages, host_cache_pages=host_cache_pages, host_disk_pages=host_disk_pages,
                      page_bytes=PAGE_BYTES, max_concurrency=3, max_model_len=48)
        core, runner = make_core(fail=fail, **config)
        collected = Collected()
        for w, wave in enumerate(waves):
            if w == restart_after and host_disk_pages:
                core, runner = make_core(fail=fail, disk=runner.disk, **config)
            for i, (seed, length) in enumerate(wave):
                core.add_request(prompt_request(f"w{w}r{i}", tokens(length, seed), max_tokens=3))
            run_until_idle(core, collected)
            assert_idle(core)
            host = core.scheduler.host_cache
            if host is not None:
                # the index is the directory but for drops still waiting for a plan with work
                assert set(host._disk) <= set(runner.disk) <= set(host._disk) | set(host._disk_drop)
                assert host.num_disk_records <= host_disk_pages
        return core, collected

    on, collected_on = run_waves(host_pages, disk_pages)
    _, collected_off = run_waves(0, 0)
    assert collected_on.tokens == collected_off.tokens
    assert on.is_healthy and not any(o.finish_reason == "error" for o in collected_on.final.values())
