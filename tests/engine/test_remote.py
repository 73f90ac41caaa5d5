"""The engine behind a Unix socket (helios/engine/remote.py): EngineServer over an AsyncEngine with a fake runner,
EngineClients on their own event loops as the HTTP processes have them. Tokens, verdicts, aborts, a frontend that
goes away, the engine going away, the metrics query with the frontends' counters summed."""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
import time

import pytest

from helios.engine.async_engine import AsyncEngine, EngineUnavailable, QueueFull
from helios.engine.messages import FrontendStats
from helios.engine.remote import EngineClient, EngineServer
from tests.engine.fakes import make_core, reference_tokens, request
from tests.engine.test_async_engine import GatedRunner, assert_pages_free


@pytest.fixture
def served():
    """(engine server, socket path, core, gated runner); every connection sees Ready at once."""
    core, fake = make_core(max_concurrency=4, max_waiting=2, num_pages=256, max_model_len=2048)
    gated = GatedRunner(fake)
    core.runner = gated
    engine = AsyncEngine(core)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.sock")
        server = EngineServer(path)
        server.start(engine)
        server.mark_ready()
        yield server, path, core, gated
        server.close()
        engine.shutdown()


async def connected(path: str) -> EngineClient:
    client = EngineClient(path)
    await client.connect(timeout=5)
    return client


async def consume(client: EngineClient, req):
    outputs = [o async for o in await client.submit(req)]
    return [t for o in outputs for t in o.new_token_ids], outputs


def wait_until(condition, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        time.sleep(0.01)


def test_streams_from_two_frontends_match_the_reference(served):
    _, path, core, _ = served
    reqs = [request(f"r{i}", prompt_len=5 + i, seed=i, max_tokens=3 + i) for i in range(6)]

    async def frontend(part):
        client = await connected(path)
        try:
            return await asyncio.gather(*(consume(client, r) for r in part))
        finally:
            client.shutdown()

    # two event loops on two threads: two connections, as two HTTP processes
    results: dict[int, list] = {}
    threads = [threading.Thread(target=lambda k=k: results.__setitem__(k, asyncio.run(frontend(reqs[k::2]))))
               for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    for k in range(2):
        for r, (tokens, outputs) in zip(reqs[k::2], results[k]):
            assert tokens == reference_tokens(r), r.req_id
            assert outputs[-1].finish_reason == "length" and not any(o.finished for o in outputs[:-1])
    wait_until(lambda: core.scheduler.block_pool.num_free_blocks == core.scheduler.block_pool.num_blocks)


def test_refusals_cross_the_socket_as_the_same_exceptions(served):
    _, path, _, gated = served

    async def main():
        client = await connected(path)
        gated.delay = 0.005  # 200 tokens take a second: nothing finishes while the test looks
        running = [await client.submit(request(f"a{i}", max_tokens=200)) for i in range(4)]  # every slot
        gated.gate.clear()
        gated.entered.clear()
        await asyncio.to_thread(gated.entered.wait, 5)  # the engine is inside a step
        waiting = [asyncio.create_task(client.submit(request(f"w{i}", max_tokens=3))) for i in range(3)]
        await asyncio.sleep(0.05)
        with pytest.raises(ValueError, match="already active"):  # this frontend knows at once
            await client.submit(request("w0"))
        gated.gate.set()
        verdicts = await asyncio.gather(*waiting, return_exceptions=True)
        assert sum(isinstance(v, QueueFull) for v in verdicts) == 1  # the queue holds two
        for i in range(4):
            client.abort(f"a{i}")
        for stream in running:
            assert [o async for o in stream][-1].finish_reason == "abort"
        for stream in [v for v in verdicts if not isinstance(v, BaseException)]:
            assert [o async for o in stream][-1].finish_reason == "length"
        client.shutdown()

    asyncio.run(main())


def test_abort_and_a_closed_stream_free_the_pages(served):
    _, path, core, gated = served

    async def main():
        client = await connected(path)
        gated.delay = 0.002  # 1500 tokens take seconds, not the few milliseconds of the bare fake
        stream = await client.submit(request("a", max_tokens=1500))
        seen = []
        async for out in stream:
            seen.append(out)
            if len(seen) == 3:  # hold the engine in a step while the abort crosses the socket
                gated.gate.clear()
                client.abort("a")
                await asyncio.sleep(0.05)
                gated.gate.set()
        assert seen[-1].finish_reason == "abort"
        other = await client.submit(request("b", max_tokens=1500))
        async for out in other:
            if out.new_token_ids:
                break
        await other.aclose()  # the consumer left: the engine aborts it, nothing comes back
        tokens, _ = await consume(client, request("b", max_tokens=2))  # the id is free again
        assert tokens == reference_tokens(request("b", max_tokens=2))
        client.shutdown()

    asyncio.run(main())
    wait_until(lambda: core.scheduler.block_pool.num_free_blocks == core.scheduler.block_pool.num_blocks)


def test_a_frontend_that_goes_away_has_its_requests_aborted(served):
    _, path, core, gated = served

    async def main():
        client = await connected(path)
        await client.submit(request("x", max_tokens=1500))
        await client.submit(request("y", max_tokens=1500))
        gated.gate.clear()
        gated.entered.clear()
        await asyncio.to_thread(gated.entered.wait, 5)
        client._writer.transport.abort()  # the process died: no goodbye
        gated.gate.set()

    asyncio.run(main())
    wait_until(lambda: not core.has_unfinished_requests())
    wait_until(lambda: core.scheduler.block_pool.num_free_blocks == core.scheduler.block_pool.num_blocks)
    assert_pages_free(core)


def test_metrics_sum_every_frontend(served):
    server, path, core, _ = served

    async def main():
        a, b = await connected(path), await connected(path)
        await consume(a, request("m", max_tokens=4))
        b.report(FrontendStats(http_requests=2, admission_slots=5, admission_in_use=1, first_response=[(1.0, 0.25)]))
        await asyncio.sleep(0.1)
        total = await a.refresh_metrics(FrontendStats(http_requests=3, admission_slots=5,
                                                      first_response=[(0.5, 0.5)]))
        assert total.http_requests == 5 and total.admission_slots == 10 and total.admission_in_use == 1
        assert sorted(s for _, s in total.first_response) == [0.25, 0.5]
        assert a.metrics().completed == 1 and a.metrics().generated_tokens == 4
        a.shutdown()
        b.shutdown()

    asyncio.run(main())


def test_the_engine_going_away_ends_streams_and_refuses_work(served):
    server, path, _, gated = served
    lost = threading.Event()

    async def main():
        client = EngineClient(path, on_lost=lost.set)
        await client.connect(timeout=5)
        stream = await client.submit(request("z", max_tokens=1500))
        gated.gate.clear()
        gated.entered.clear()
        await asyncio.to_thread(gated.entered.wait, 5)
        server.close()  # the engine process is gone
        outputs = [o async for o in stream]
        assert outputs[-1].finish_reason == "error" and "engine" in outputs[-1].error
        assert not client.is_healthy
        with pytest.raises(EngineUnavailable):
            await client.submit(request("z2"))
        gated.gate.set()

    asyncio.run(main())
    assert lost.is_set()


def test_a_failed_start_reaches_connect():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "engine.sock")
        server = EngineServer(path)

        async def main():
            client = EngineClient(path)
            connecting = asyncio.create_task(client.connect(timeout=5))
            await asyncio.sleep(0.05)
            assert not connecting.done()  # nothing is served before the engine is ready
            server.mark_ready(error="weights are corrupt")
            with pytest.raises(EngineUnavailable, match="weights are corrupt"):
                await connecting

        asyncio.run(main())
        server.close()


def test_a_slow_frontend_never_stalls_the_engine(served):
    """A frontend that stops reading: the engine thread keeps stepping (what the socket does not take waits
    for the connection's writer thread)."""
    server, path, core, _ = served
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    import msgspec

    from helios.engine.remote import Submit, _frame

    encoder = msgspec.msgpack.Encoder()
    for i in range(4):
        sock.sendall(_frame(encoder, Submit(request=request(f"s{i}", max_tokens=1500, prompt_len=8))))
    # never read: thousands of rounds are far more than the socket buffers, yet every request runs to its end
    engine = server.engine
    wait_until(lambda: engine.metrics().completed == 4, timeout=30)
    assert engine.metrics().generated_tokens > 1000
    sock.close()
