"""AsyncEngine with a fake runner: concurrent streams, the inbox (adds and aborts at step boundaries, admission
verdicts, aborts that win over a running step), runner failures, idle wait, shutdown."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from helios.engine.async_engine import AsyncEngine, EngineUnavailable, QueueFull
from tests.engine.fakes import make_core, reference_tokens, request


class GatedRunner:
    """Wraps a runner: `gate` cleared blocks execute; `entered` is set once execute is running."""

    def __init__(self, inner, delay: float = 0.0) -> None:
        self.inner = inner
        self.delay = delay
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.num_calls = 0

    def execute(self, plan):
        self.num_calls += 1
        self.entered.set()
        assert self.gate.wait(10), "test gate never opened"
        if self.delay:
            time.sleep(self.delay)
        return self.inner.execute(plan)


def make_engine(delay: float = 0.0, **config):
    core, fake = make_core(**config)
    gated = GatedRunner(fake, delay)
    core.runner = gated
    return AsyncEngine(core), core, gated


async def consume(engine, req):
    outputs = []
    async for out in await engine.submit(req):
        outputs.append(out)
    return [t for o in outputs for t in o.new_token_ids], outputs


def assert_pages_free(core):
    pool = core.scheduler.block_pool
    pool.check_invariants()
    assert pool.num_free_blocks == pool.num_blocks


def test_concurrent_submits_stream_the_same_tokens_as_alone():
    engine, core, _ = make_engine(max_concurrency=3, max_waiting=16)
    reqs = [request(f"r{i}", prompt_len=5 + i, seed=i, max_tokens=4 + i) for i in range(8)]

    async def main():
        return await asyncio.gather(*(consume(engine, r) for r in reqs))

    results = asyncio.run(main())
    for r, (tokens, outputs) in zip(reqs, results):
        assert tokens == reference_tokens(r), r.req_id
        assert outputs[-1].finished and outputs[-1].finish_reason == "length"
        assert not any(o.finished for o in outputs[:-1])
    m = engine.metrics()
    assert m.completed == 8 and m.generated_tokens == sum(4 + i for i in range(8))
    assert engine.is_healthy
    engine.shutdown()
    assert_pages_free(core)


def test_abort_mid_stream_frees_pages_and_ends_the_stream():
    engine, core, _ = make_engine(delay=0.002, num_pages=1024, max_model_len=4096)

    async def main():
        stream = await engine.submit(request("a", max_tokens=3000))
        seen = []
        async for out in stream:
            seen.append(out)
            if len(seen) == 3:
                engine.abort("a")
        # freed by the engine thread before the abort record was delivered
        assert engine.metrics().free_pages == 1024 and engine.metrics().active == 0
        return seen

    seen = asyncio.run(main())
    assert seen[-1].finished and seen[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in seen) < 3000
    engine.shutdown()
    assert_pages_free(core)


def test_closing_the_stream_aborts_the_request():
    engine, core, _ = make_engine(delay=0.002, num_pages=1024, max_model_len=4096)

    async def main():
        stream = await engine.submit(request("a", max_tokens=3000))
        async for out in stream:
            if out.new_token_ids:
                break
        await stream.aclose()
        # the id is free for a new request at once: the inbox aborts the old one first, and none of its
        # tokens reach the new stream
        tokens, outputs = await consume(engine, request("a", max_tokens=2))
        assert tokens == reference_tokens(request("a", max_tokens=2))

    asyncio.run(main())
    engine.shutdown()
    assert_pages_free(core)


def test_abort_while_the_step_executes():
    engine, core, gated = make_engine()

    async def main():
        gated.gate.clear()
        stream = await engine.submit(request("a", max_tokens=50))
        await asyncio.to_thread(gated.entered.wait, 5)
        engine.abort("a")
        gated.gate.set()
        return [o async for o in stream], engine.metrics()

    outputs, metrics = asyncio.run(main())
    assert [o.finish_reason for o in outputs] == ["abort"]  # the running step's token is not delivered
    assert metrics.free_pages == metrics.total_pages
    engine.shutdown()
    assert_pages_free(core)


def test_queue_full_through_submit():
    engine, core, gated = make_engine(max_concurrency=1, max_num_batched_tokens=8, max_waiting=1)

    async def main():
        gated.gate.clear()
        first = await engine.submit(request("a", max_tokens=3))  # admitted before its first step
        await asyncio.to_thread(gated.entered.wait, 5)  # "a" is running: the queue is empty
        # the verdicts come at the next step boundary, in arrival order
        second = asyncio.create_task(engine.submit(request("b", max_tokens=3)))
        third = asyncio.create_task(engine.submit(request("c")))
        await asyncio.sleep(0.01)
        assert not second.done() and not third.done()
        with pytest.raises(ValueError, match="already active"):  # known at once: "b" is in flight
            await engine.submit(request("b"))
        gated.gate.set()
        second = await second
        with pytest.raises(QueueFull, match="queue is full"):
            await third
        return [o async for o in first], [o async for o in second]

    a, b = asyncio.run(main())
    assert a[-1].finish_reason == b[-1].finish_reason == "length"
    assert engine.metrics().failed == 1
    engine.shutdown()


def test_runner_exception_fails_requests_and_marks_unhealthy():
    def fail(plan):
        if any(s.num_computed_tokens > 0 for s in plan.scheduled):
            return RuntimeError("CUDA error: an illegal memory access")
        return None

    core, fake = make_core(fail=fail)
    engine = AsyncEngine(core)

    async def main():
        results = await asyncio.gather(*(consume(engine, request(f"r{i}", max_tokens=5)) for i in range(3)))
        with pytest.raises(EngineUnavailable, match="illegal memory access"):
            await engine.submit(request("late"))
        return results

    results = asyncio.run(main())
    for _, outputs in results:
        assert outputs[-1].finish_reason == "error" and "illegal memory access" in outputs[-1].error
    assert not engine.is_healthy and "illegal memory access" in engine.error
    assert engine.metrics().failed == 3
    engine.shutdown()
    assert_pages_free(core)


def test_idle_loop_sleeps_without_stepping():
    engine, core, gated = make_engine()
    steps = []
    original = core.step
    core.step = lambda: steps.append(1) or original()

    async def main():
        await consume(engine, request("a", max_tokens=3))

    asyncio.run(main())
    num_steps = len(steps)
    time.sleep(0.1)
    assert len(steps) == num_steps, "the loop stepped while idle"
    assert engine._loop_thread.is_alive()
    asyncio.run(main())  # and it wakes up again
    assert len(steps) > num_steps
    engine.shutdown()


def test_shutdown_joins_the_thread_and_ends_open_streams():
    engine, core, _ = make_engine(delay=0.002, num_pages=1024, max_model_len=4096)

    async def main():
        stream = await engine.submit(request("a", max_tokens=3000))
        first = await anext(stream)
        await asyncio.to_thread(engine.shutdown, 5)
        rest = [o async for o in stream]
        return first, rest

    first, rest = asyncio.run(main())
    assert not engine._loop_thread.is_alive()
    assert rest and rest[-1].finish_reason == "abort"
    assert not engine.is_healthy
    assert_pages_free(core)

    async def late():
        await engine.submit(request("b"))

    with pytest.raises(EngineUnavailable):
        asyncio.run(late())


def test_a_refused_request_frees_its_id():
    engine, core, _ = make_engine(max_model_len=64)

    async def main():
        with pytest.raises(ValueError, match="exceeds max_model_len"):
            await engine.submit(request("a", prompt_len=100))
        tokens, _ = await consume(engine, request("a", max_tokens=2))
        return tokens

    assert len(asyncio.run(main())) == 2
    assert engine.metrics().failed == 1
    engine.shutdown()
    assert_pages_free(core)


def test_a_submitter_cancelled_while_waiting_for_admission_aborts_the_request():
    engine, core, gated = make_engine(num_pages=1024, max_model_len=4096)

    async def main():
        gated.gate.clear()
        first = await engine.submit(request("a", max_tokens=3))
        await asyncio.to_thread(gated.entered.wait, 5)
        late = asyncio.create_task(engine.submit(request("b", max_tokens=3000)))
        await asyncio.sleep(0.01)
        late.cancel()  # the client went away before the engine answered
        with pytest.raises(asyncio.CancelledError):
            await late
        gated.gate.set()
        outputs = [o async for o in first]
        while engine.metrics().active or engine.metrics().pending:
            await asyncio.sleep(0.005)
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "length"
    m = engine.metrics()
    assert m.free_pages == m.total_pages and m.generated_tokens < 100  # "b" did not run on
    engine.shutdown()
    assert_pages_free(core)


def test_the_scheduler_is_touched_only_by_the_engine_thread():
    engine, core, _ = make_engine(delay=0.001, max_concurrency=2, max_waiting=16)
    threads = set()
    scheduler = core.scheduler
    for name in ("add_request", "abort", "schedule", "update"):
        original = getattr(scheduler, name)

        def wrapped(*args, _original=original, **kw):
            threads.add(threading.current_thread().name)
            return _original(*args, **kw)

        setattr(scheduler, name, wrapped)

    async def main():
        stream = await engine.submit(request("x", max_tokens=500))
        task = asyncio.gather(*(consume(engine, request(f"r{i}", max_tokens=4)) for i in range(4)))
        async for out in stream:
            if out.new_token_ids:
                engine.abort("x")
        await task

    asyncio.run(main())
    engine.shutdown()
    assert threads == {"helios-engine"}


def test_a_crashed_engine_loop_fails_every_stream_and_refuses_new_work():
    engine, core, gated = make_engine()

    def broken_schedule():
        raise RuntimeError("a scheduler bug")

    async def main():
        gated.gate.clear()
        stream = await engine.submit(request("a", max_tokens=50))
        await asyncio.to_thread(gated.entered.wait, 5)
        core.scheduler.schedule = broken_schedule  # the next step crashes the loop
        gated.gate.set()
        outputs = [o async for o in stream]
        with pytest.raises(EngineUnavailable, match="a scheduler bug"):
            await engine.submit(request("b"))
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finish_reason == "error"
    assert "engine loop crashed: RuntimeError: a scheduler bug" in outputs[-1].error
    assert not engine.is_healthy
    engine.shutdown(5)  # returns: the broken core is left alone


def test_a_group_submitted_together_is_admitted_in_one_round():
    engine, core, _ = make_engine(max_concurrency=4)
    rounds = []
    original = core.scheduler.schedule

    def schedule():
        plan = original()
        rounds.append(sorted(n.req_id for n in plan.new_requests))
        return plan

    core.scheduler.schedule = schedule

    async def main():
        streams = await asyncio.gather(*(engine.submit(request(f"c{i}", max_tokens=2)) for i in range(4)))
        for stream in streams:
            async for _ in stream:
                pass

    asyncio.run(main())
    engine.shutdown()
    assert rounds[0] == ["c0", "c1", "c2", "c3"]


def test_the_loop_can_run_on_the_thread_that_built_the_engine():
    """own_thread=False: run() is the step loop on the caller (the engine process's main thread); shutdown from
    another thread ends it and every open stream."""
    core, fake = make_core(max_concurrency=3, max_waiting=16)
    engine = AsyncEngine(core, own_thread=False)
    reqs = [request(f"m{i}", prompt_len=5 + i, seed=i, max_tokens=4 + i) for i in range(4)]
    results = {}

    def client():
        async def main():
            return await asyncio.gather(*(consume(engine, r) for r in reqs))
        results["done"] = asyncio.run(main())
        engine.shutdown(5)

    t = threading.Thread(target=client)
    t.start()
    engine.run()  # returns once the client thread shut the engine down
    t.join(5)
    for r, (tokens, _) in zip(reqs, results["done"]):
        assert tokens == reference_tokens(r), r.req_id
    assert not engine.is_healthy
    assert_pages_free(core)


class DeferredWorkRunner:
    """A runner with deferred start-up work (graphs left to capture): records the thread and the time of each
    unit, and whether a step was running meanwhile."""

    def __init__(self, inner, units: int) -> None:
        self.inner = inner
        self.pending = units
        self.calls: list[tuple[float, int]] = []  # (monotonic time, thread id)
        self.in_step = False

    @property
    def has_pending_captures(self) -> bool:
        return self.pending > 0

    def capture_pending(self) -> bool:
        assert not self.in_step, "deferred work ran inside a step"
        self.calls.append((time.monotonic(), threading.get_ident()))
        self.pending -= 1
        return self.pending > 0

    def execute(self, plan):
        self.in_step = True
        try:
            time.sleep(0.002)
            return self.inner.execute(plan)
        finally:
            self.in_step = False


def test_deferred_runner_work_runs_when_idle_and_sparsely_under_load():
    import helios.engine.async_engine as async_engine

    core, fake = make_core(num_pages=1024, max_model_len=4096)
    runner = core.runner = DeferredWorkRunner(fake, units=3)
    engine = AsyncEngine(core)
    deadline = time.monotonic() + 5
    while runner.pending and time.monotonic() < deadline:  # idle: every unit at once
        time.sleep(0.01)
    assert runner.pending == 0 and len({t for _, t in runner.calls}) == 1
    engine.shutdown()

    core, fake = make_core(num_pages=1024, max_model_len=4096)
    runner = core.runner = DeferredWorkRunner(fake, units=50)
    engine = AsyncEngine(core, own_thread=False)

    def client():
        async def main():
            return await consume(engine, request("busy", max_tokens=400))
        results["tokens"] = asyncio.run(main())[0]
        engine.shutdown(5)

    results = {}
    runner.pending = 0  # nothing deferred until the request runs
    t = threading.Thread(target=client)
    t.start()
    time.sleep(0.05)
    runner.pending = 50
    engine._wake()
    engine.run()
    t.join(5)
    assert results["tokens"] == reference_tokens(request("busy", max_tokens=400))
    busy = [at for at, _ in runner.calls]
    gaps = [b - a for a, b in zip(busy, busy[1:])]
    # under load at most one unit per interval (the loop may go idle at the end and take the rest at once)
    assert busy and all(g >= async_engine.BACKGROUND_INTERVAL_S * 0.9 for g in gaps[:1])


class CapturingRunner(GatedRunner):
    """A runner with deferred captures (ModelRunner.has_pending_captures / capture_pending), counted in stats."""

    def __init__(self, inner, num_pending: int) -> None:
        super().__init__(inner)
        self.num_pending = num_pending

    @property
    def has_pending_captures(self) -> bool:
        return self.num_pending > 0

    def capture_pending(self) -> bool:
        self.num_pending -= 1
        return self.num_pending > 0

    def stats(self):
        from helios.engine.messages import RunnerStats

        return RunnerStats(graph_captures_pending=self.num_pending)


def test_idle_background_captures_reach_the_published_metrics():
    core, fake = make_core()
    core.runner = CapturingRunner(fake, num_pending=3)
    engine = AsyncEngine(core)  # the constructor publishes the first metrics: three pending
    deadline = time.monotonic() + 10
    # no request ever comes: only the idle loop's own publication can show the captures done
    while engine.metrics().graph_captures_pending and time.monotonic() < deadline:
        time.sleep(0.01)
    assert core.runner.num_pending == 0
    assert engine.metrics().graph_captures_pending == 0
    engine.shutdown()
