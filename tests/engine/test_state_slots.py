"""State slots of hybrid models (helios/engine/state_pool.py, the scheduler's admission and release): a fake
runner keeps each slot's simulated recurrent state (the tokens it absorbed) and checks that every chunk finds
exactly its own request's earlier tokens there, that a fresh request never reads a slot, that two running
requests never share one, and that split prefill chunks end on the recurrent chunk grid."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from helios.engine.messages import SchedulerOutput
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import Collected, FakeRunner, make_core, reference_tokens, request, run_until_idle


class StateRunner(FakeRunner):
    """FakeRunner plus the recurrent state: slot -> the tokens its request has absorbed."""

    def __init__(self, inner: FakeRunner, num_slots: int, grid: int) -> None:
        self.__dict__.update(inner.__dict__)
        self.num_slots = num_slots
        self.grid = grid
        self.states: dict[int, list[int]] = {}
        self.num_fresh = 0
        self.unaligned: list[tuple[str, int, int]] = []

    def execute(self, plan: SchedulerOutput):
        slots = [s.state_slot for s in plan.scheduled]
        assert all(0 <= slot < self.num_slots for slot in slots), slots
        assert len(set(slots)) == len(slots), f"two requests of one step share a state slot: {slots}"
        output = super().execute(plan)  # the page checks; also learns new requests' tokens
        for s in plan.scheduled:
            known = self.known[s.req_id]
            if s.num_computed_tokens == 0:
                self.states[s.state_slot] = []  # fresh: the kernel starts from zeros, never reads the slot
                self.num_fresh += 1
            else:
                state = self.states.get(s.state_slot)
                assert state == known[: s.num_computed_tokens], f"{s.req_id} reads another request's state"
            self.states[s.state_slot] = known[: s.num_computed_tokens] + list(s.token_ids)
            end = s.num_computed_tokens + len(s.token_ids)
            if not s.sample and end < len(known) and len(s.token_ids) > 1 and end % self.grid:
                self.unaligned.append((s.req_id, s.num_computed_tokens, end))
        return output


def make_hybrid(num_state_slots=4, state_chunk=8, **config):
    core, fake = make_core(num_state_slots=num_state_slots, state_chunk=state_chunk, **config)
    runner = StateRunner(fake, num_state_slots, state_chunk)
    core.runner = runner
    return core, runner


def assert_slots_free(core) -> None:
    pool = core.scheduler.state_pool
    assert pool.num_free_slots == pool.num_slots
    metrics = core.metrics()
    assert metrics.state_slots_in_use == 0 and metrics.state_slots_total == pool.num_slots


def test_every_request_continues_its_own_state_through_chunks_and_preemption():
    # 24 pages of 4 tokens for 6 requests of up to 60 tokens: preemptions recompute from a fresh slot
    core, runner = make_hybrid(num_state_slots=4, max_concurrency=4, num_pages=24, prefill_chunk_size=16,
                               max_num_batched_tokens=40)
    reqs = [request(f"r{i}", prompt_len=10 + 7 * i, seed=i, max_tokens=12 + i) for i in range(6)]
    for r in reqs:
        core.add_request(r)
    collected = run_until_idle(core)
    for r in reqs:
        assert collected.tokens[r.req_id] == reference_tokens(r), r.req_id
    assert core.scheduler.num_preemptions > 0
    assert runner.num_fresh == len(reqs) + core.scheduler.num_preemptions
    assert not runner.unaligned
    assert_slots_free(core)


def test_split_prefill_chunks_end_on_the_recurrent_grid():
    core, runner = make_hybrid(num_state_slots=2, state_chunk=8, max_concurrency=2, prefill_chunk_size=20,
                               max_num_batched_tokens=27, num_pages=64)
    core.add_request(request("a", prompt_len=61, max_tokens=3))
    core.add_request(request("b", prompt_len=45, max_tokens=3, seed=1))
    ends = []
    collected = Collected()
    while core.has_unfinished_requests():
        collected.add(core.step())
        ends.extend((s.req_id, s.num_computed_tokens + len(s.token_ids)) for s in runner.plans[-1].scheduled
                    if len(s.token_ids) > 1)
    assert ends and all(end % 8 == 0 or end in (61, 45) for _, end in ends), ends
    assert ("a", 16) in ends  # the chunk of 20 is cut back to 16
    assert not runner.unaligned
    assert_slots_free(core)


def test_admission_waits_for_a_free_slot():
    core, runner = make_hybrid(num_state_slots=2, max_concurrency=4)
    reqs = [request(f"r{i}", prompt_len=6, seed=i, max_tokens=5) for i in range(4)]
    for r in reqs:
        core.add_request(r)
    collected = Collected()
    collected.add(core.step())
    assert core.scheduler.num_running == 2 and core.metrics().state_slots_in_use == 2
    run_until_idle(core, collected)
    assert all(collected.tokens[r.req_id] == reference_tokens(r) for r in reqs)
    assert max(len(p.scheduled) for p in runner.plans) == 2
    assert_slots_free(core)


def test_the_prefix_cache_is_off_for_a_model_with_state():
    # pages alone cannot resume a recurrent layer: until state checkpoints, identical prompts recompute
    core, _ = make_hybrid(enable_prefix_caching=True, host_cache_pages=8)
    assert core.scheduler.prefix_cache is None and core.scheduler.host_cache is None
    for rid in ("a", "b"):
        core.add_request(request(rid, prompt_len=24, max_tokens=2))
        run_until_idle(core)
    assert core.metrics().reused_tokens == 0


def test_abort_frees_the_slot_in_every_state():
    core, _ = make_hybrid(num_state_slots=2, max_concurrency=2, prefill_chunk_size=4, state_chunk=4)
    core.add_request(request("run", prompt_len=20, max_tokens=50))
    core.add_request(request("pre", prompt_len=20, max_tokens=50, seed=1))
    core.add_request(request("wait", prompt_len=5, max_tokens=5, seed=2))
    core.step()  # both prefilling, one waiting for a slot
    assert core.metrics().state_slots_in_use == 2
    for rid in ("run", "wait"):
        assert core.abort(rid).finish_reason == "abort"
    assert core.metrics().state_slots_in_use == 1
    core.abort("pre")
    assert_slots_free(core)


def test_config_guarantees_the_first_request_reaches_the_grid():
    import pytest

    from helios.engine.config import SchedulerConfig

    with pytest.raises(ValueError, match="max_concurrency \\+ state_chunk"):
        SchedulerConfig(max_concurrency=8, max_num_batched_tokens=70, state_chunk=64, prefill_chunk_size=64)
    with pytest.raises(ValueError, match="prefill_chunk_size"):
        SchedulerConfig(max_num_batched_tokens=512, state_chunk=64, prefill_chunk_size=32)
    SchedulerConfig(max_concurrency=8, max_num_batched_tokens=71, state_chunk=64, prefill_chunk_size=64)


_op = st.one_of(
    st.tuples(st.just("add"), st.integers(1, 40), st.integers(0, 12)),
    st.tuples(st.just("abort"), st.integers(0, 30)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(_op, max_size=50), num_pages=st.integers(3, 24), concurrency=st.integers(1, 5),
       slots=st.integers(1, 5), chunk=st.integers(1, 12), grid=st.sampled_from([0, 4, 8]))
def test_random_add_abort_step_keep_slots_consistent(ops, num_pages, concurrency, slots, chunk, grid):
    core, runner = make_hybrid(num_state_slots=slots, state_chunk=grid, num_pages=num_pages,
                               max_concurrency=concurrency, prefill_chunk_size=max(chunk, grid),
                               max_num_batched_tokens=max(concurrency + grid, 10), max_waiting=8, max_model_len=48)
    runner.grid = grid or 1
    sched = core.scheduler
    collected = Collected()
    added: list[str] = []

    def check():
        held = [r.state_slot for r in sched.requests.values() if r.state_slot >= 0]
        assert len(held) == len(set(held)) == sched.state_pool.num_slots - sched.state_pool.num_free_slots
        assert all(r.state_slot >= 0 for r in sched.running)
        assert len(sched.running) <= min(concurrency, slots)

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
    assert_slots_free(core)
