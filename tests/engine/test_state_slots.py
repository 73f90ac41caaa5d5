"""State slots of hybrid models (helios/engine/state_pool.py, the scheduler's admission and release): a fake
runner keeps each slot's simulated recurrent state (the tokens it absorbed) and checks that every chunk finds
exactly its own request's earlier tokens there, that a fresh request never reads a slot, that two running
requests never share one, and that split prefill chunks end on the recurrent chunk grid."""

from __future__ import annotations

import msgspec
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
        self.num_copies = 0
        self.num_host_restores = 0
        self.state_records: dict[int, list[int]] = {}  # host DRAM state record -> the tokens its state absorbed
        self.state_disk: dict[bytes, list[int]] = {}  # disk state records by hash
        self.unaligned: list[tuple[str, int, int]] = []

    def execute(self, plan: SchedulerOutput):
        # the state tiers in the runner's order: spill, disk drop, copy-out, slot copies, load, copy-in
        for record, block_hash in plan.state_spill:
            assert record in self.state_records, f"spill of state record {record}, never written"
            self.state_disk[block_hash] = list(self.state_records[record])
        for block_hash in plan.state_disk_drop:
            self.state_disk.pop(block_hash, None)
        for slot, record in plan.state_copy_out:
            assert slot in self.states, f"copy-out of state slot {slot}, never written"
            self.state_records[record] = list(self.states[slot])
        for src, dst in plan.state_copies:  # captures, then restores: before anything of the plan reads a slot
            assert src in self.states, f"copy from state slot {src}, never written"
            self.states[dst] = list(self.states[src])
            self.num_copies += 1
        for block_hash, record in plan.state_load:
            assert block_hash in self.state_disk, "load of a state record never spilled"
            self.state_records[record] = list(self.state_disk[block_hash])
        for record, slot in plan.state_copy_in:
            assert record in self.state_records, f"copy-in of state record {record}, never written"
            self.states[slot] = list(self.state_records[record])
            self.num_host_restores += 1
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
    runner = StateRunner(fake, core.scheduler.state_pool.num_slots, state_chunk)
    core.runner = runner
    return core, runner


def assert_slots_free(core) -> None:
    pool = core.scheduler.state_pool
    held = core.scheduler.checkpoints.num_held if core.scheduler.checkpoints else 0
    assert pool.num_free_slots == pool.num_slots - held
    metrics = core.metrics()
    assert metrics.state_slots_in_use == held and metrics.state_slots_total == pool.num_slots


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


def test_without_checkpoint_slots_the_prefix_cache_is_off_for_a_model_with_state():
    # pages alone cannot resume a recurrent layer: without state checkpoints identical prompts recompute
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
       slots=st.integers(1, 5), chunk=st.integers(1, 12), grid=st.sampled_from([0, 4, 8]),
       checkpoints=st.integers(0, 2), host=st.sampled_from([(0, 0, 0, 0), (1, 0, 2, 0), (1, 3, 2, 8)]))
def test_random_add_abort_step_keep_slots_consistent(ops, num_pages, concurrency, slots, chunk, grid, checkpoints,
                                                     host):
    host_states, state_disk, host_pages, page_disk = host
    core, runner = make_hybrid(num_state_slots=slots, state_chunk=grid, num_pages=num_pages,
                               max_concurrency=concurrency, prefill_chunk_size=max(chunk, grid),
                               max_num_batched_tokens=max(concurrency + grid, 10), max_waiting=8, max_model_len=48,
                               state_checkpoint_slots=checkpoints, enable_prefix_caching=bool(checkpoints),
                               state_slot_bytes=100, state_copy_bytes_per_s=1e12, host_state_records=host_states,
                               host_state_disk_records=state_disk, host_cache_pages=host_pages,
                               host_disk_pages=page_disk, page_bytes=10)
    runner.grid = grid or 1
    sched = core.scheduler
    if sched.checkpoints is not None:
        sched.observe_prefill(10, 0.01)
    collected = Collected()
    added: list[str] = []

    def check():
        held = [r.state_slot for r in sched.requests.values() if r.state_slot >= 0]
        held += list(sched.checkpoints.slots.values()) + list(sched.checkpoints.guards.values()) \
            if sched.checkpoints else []
        assert len(held) == len(set(held)) == sched.state_pool.num_slots - sched.state_pool.num_free_slots
        assert all(r.state_slot >= 0 for r in sched.running)
        assert len(sched.running) <= min(concurrency, slots)

    for op in ops:
        if op[0] == "add":
            rid = f"r{len(added)}"
            try:
                # an anchor and a message end inside the prompt (test_checkpoint_roles): guards and cut chunks too
                core.add_request(msgspec.structs.replace(
                    request(rid, prompt_len=op[1], max_tokens=op[2], seed=len(added) % 3),
                    anchor_end=op[1] // 2, message_ends=[op[1] * 3 // 4]))
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


# --- state checkpoints (helios/engine/state_checkpoints.py) -----------------------------------------------------


def make_checkpointed(**config):
    defaults = dict(num_state_slots=2, state_checkpoint_slots=2, state_chunk=8, page_size=4, max_concurrency=2,
                    prefill_chunk_size=16, max_num_batched_tokens=32, enable_prefix_caching=True,
                    state_slot_bytes=1000, state_copy_bytes_per_s=1e12)
    core, runner = make_hybrid(**{**defaults, **config})
    core.scheduler.observe_prefill(100, 0.01)  # a measured prefill rate: the cost rule can decide
    return core, runner


def test_a_second_turn_restores_the_first_turns_state():
    core, runner = make_checkpointed()
    first = request("t1", prompt_len=21, max_tokens=12)
    collected = Collected()
    core.add_request(first)
    run_until_idle(core, collected)
    # its prompt ends at 21: chunks 0-16 (the grid of 8 and page 4: lcm 8) then 16-21; its decode passes 24, 32
    ckpt = core.scheduler.checkpoints
    # the prompt's (16) stays; the decode's (24, then 32) replaced each other
    assert ckpt.captures["endpoint"] == 3 and ckpt.num_held == 2
    history = first.prompt_token_ids + collected.tokens["t1"]  # 33 tokens: 32 computed, the last sampled
    second = request("t2", prompt_len=0, max_tokens=6)
    second = type(second)(req_id="t2", prompt_token_ids=history + [11, 12, 13, 14, 15], sampling=second.sampling)
    core.add_request(second)
    out = run_until_idle(core, Collected())
    assert out.final["t2"].num_cached_tokens == 32  # the checkpoint at 32 and its 8 pages
    assert out.tokens["t2"] == reference_tokens(second)
    assert runner.num_copies >= 3  # captures, and the restore
    assert_slots_free(core)


def test_checkpoints_never_take_a_running_request_s_slot():
    core, runner = make_checkpointed(num_state_slots=2, state_checkpoint_slots=1)
    reqs = [request(f"r{i}", prompt_len=20 + 3 * i, seed=i, max_tokens=20) for i in range(6)]
    for r in reqs:
        core.add_request(r)
    collected = run_until_idle(core)
    for r in reqs:
        assert collected.tokens[r.req_id] == reference_tokens(r), r.req_id
    assert core.scheduler.checkpoints.num_held <= 1
    assert_slots_free(core)


def test_unknown_cost_and_a_copy_dearer_than_the_prefill_skip_the_capture():
    core, runner = make_checkpointed()
    sched = core.scheduler
    sched.prefill_ns_per_token = None
    sched.add_request(request("a", prompt_len=21, max_tokens=2))
    while sched.has_unfinished_requests():  # the scheduler alone: nothing measures a prefill rate
        plan = sched.schedule()
        sched.update(plan, runner.execute(plan))
    assert sched.checkpoints.skips["unknown_cost"] >= 1 and core.metrics().checkpoints_held == 0
    core, _ = make_checkpointed(state_slot_bytes=10**12, state_copy_bytes_per_s=1.0)
    core.add_request(request("b", prompt_len=21, max_tokens=2))
    run_until_idle(core)
    metrics = core.metrics()
    assert metrics.checkpoint_skips["work_budget"] >= 1 and metrics.checkpoint_captures["endpoint"] == 0


def test_a_failed_plan_drops_the_checkpoints_it_was_capturing():
    core, runner = make_checkpointed()
    core.add_request(request("a", prompt_len=21, max_tokens=12))
    while core.scheduler.checkpoints.num_held == 0:
        core.step()
    runner.fail = lambda plan: RuntimeError("device lost") if plan.state_copies else None
    core.step()
    assert core.scheduler.checkpoints.num_held == 0


def test_a_checkpoint_the_gpu_share_evicts_comes_back_from_dram_and_disk():
    core, runner = make_checkpointed(state_checkpoint_slots=1, host_state_records=1, host_state_disk_records=16,
                                     num_pages=64)
    first = request("t1", prompt_len=21, max_tokens=12)
    collected = Collected()
    core.add_request(first)
    run_until_idle(core, collected)
    history = first.prompt_token_ids + collected.tokens["t1"]
    for i in range(3):  # each capture evicts the GPU checkpoint before it: DRAM, then disk
        core.add_request(request(f"f{i}", prompt_len=20, max_tokens=6, seed=10 + i))
        run_until_idle(core)
    assert core.scheduler.state_host.num_disk_records >= 1
    second = request("t2", prompt_len=0, max_tokens=6)
    second = type(second)(req_id="t2", prompt_token_ids=history + [11, 12, 13], sampling=second.sampling)
    core.add_request(second)
    out = run_until_idle(core, Collected())
    assert out.final["t2"].num_cached_tokens == 32 and out.tokens["t2"] == reference_tokens(second)
    assert runner.num_host_restores == 1
