"""Closed-loop streaming load on an OpenAI-style server, from several client processes (for gpu_serve_load.py).

Each stream owns one HTTP/1.1 keep-alive connection and loops: POST, read the chunked SSE reply to its end, POST
the next at once. The reply is parsed in the protocol's data_received (no task wake-up per event): per HTTP chunk a
size line, a count of event ends and one clock read; JSON is parsed only for the usage event at the end. Clocks are
time.monotonic (one system-wide clock on Linux, so the parent can give every process the same start and window).
Standard library only: the client processes are spawned and import nothing else.
Self-check: `python benchmarks/loadgen.py [--procs 1] [--streams 64]` serves a fake SSE endpoint in this process
and prints the events/s the client sustains (the client must not be what a served benchmark measures).
"""

from __future__ import annotations

import asyncio
import bisect
import json
import multiprocessing
import time
from dataclasses import dataclass, field
from queue import Empty

SALT = b"@@SALT@@"  # replaced per request by three salt items (unique prefixes: no prefix-cache hits)


@dataclass
class Job:
    """What one client process runs for one level."""

    streams: list[int]  # global stream indices of this process
    num_streams: int  # all processes together
    start: float  # stream g starts at start + g / num_streams * stagger
    stagger: float
    window: tuple[float, float]  # statistics over requests sent, and token events, inside it
    cut: float  # a request still running then is cut (its connection closed: the server aborts it)
    probe_every: float  # seconds between max_tokens=1 probes in the window (0: this process sends none)


@dataclass
class Result:
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    probe_ttft: list[float] = field(default_factory=list)
    window_tokens: float = 0.0  # token events inside the window, each worth usage tokens / token events
    num_requests: int = 0  # finished inside the window's statistics (sent inside it)
    num_tokens: int = 0  # usage completion tokens of every finished request
    num_cut: int = 0  # requests cut at the job's `cut` time
    errors: list[str] = field(default_factory=list)
    cpu_s: float = 0.0  # CPU seconds the client processes spent on the level
    wall_s: float = 0.0  # the longest client process's wall time on the level

    def merge(self, other: Result) -> None:
        for name in ("ttft", "itl", "e2e", "probe_ttft", "errors"):
            getattr(self, name).extend(getattr(other, name))
        self.window_tokens += other.window_tokens
        self.num_requests += other.num_requests
        self.num_tokens += other.num_tokens
        self.num_cut += other.num_cut
        self.cpu_s += other.cpu_s
        self.wall_s = max(self.wall_s, other.wall_s)


class Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection, parsed in data_received: no task wake-up per event, only per reply.

    request() writes a POST and returns a future of (status, the last bytes of the body); every SSE event's arrival
    time (the read that completed it) is appended to the list it was given."""

    HEAD, SIZE, DATA, TRAILER, BODY, IDLE = range(6)

    def __init__(self):
        self.buf, self.state, self.need, self.status = b"", self.IDLE, 0, 0
        self.times: list[float] = []
        self.prev = self.last = b""
        self.waiter: asyncio.Future | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def request(self, data: bytes, times: list[float]) -> asyncio.Future:
        self.times, self.state, self.prev, self.last = times, self.HEAD, b"", b""
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        return self.waiter

    def _finish(self, tail: bytes) -> None:
        self.state = self.IDLE
        if not self.waiter.done():
            self.waiter.set_result((self.status, tail))

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        buf = self.buf + data if self.buf else data
        pos = 0
        while True:
            state = self.state
            if state == self.DATA:  # the common case: one chunk, one event
                if len(buf) - pos < self.need + 2:
                    break
                chunk = buf[pos:pos + self.need]
                for _ in range(chunk.count(b"\n\n")):
                    self.times.append(now)
                self.prev, self.last = self.last, chunk
                pos += self.need + 2
                self.state = self.SIZE
            elif state == self.SIZE or state == self.TRAILER:
                end = buf.find(b"\r\n", pos)
                if end < 0:
                    break
                if state == self.TRAILER:
                    pos = end + 2
                    self._finish(self.prev + self.last)
                    continue
                self.need = int(buf[pos:end].split(b";", 1)[0], 16)
                pos = end + 2
                self.state = self.DATA if self.need else self.TRAILER
            elif state == self.HEAD:
                end = buf.find(b"\r\n\r\n", pos)
                if end < 0:
                    break
                header = buf[pos:end + 2].lower()
                pos = end + 4
                self.status = int(header[9:12])
                if b"transfer-encoding: chunked" in header:
                    self.state = self.SIZE
                else:  # an error body (or a server that does not stream)
                    self.need = int(header.split(b"content-length:")[1].split(b"\r\n")[0])
                    self.state = self.BODY
            elif state == self.BODY:
                if len(buf) - pos < self.need:
                    break
                pos += self.need
                self._finish(buf[pos - self.need:pos])
            else:  # IDLE: nothing is expected
                pos = len(buf)
                break
        self.buf = buf[pos:] if pos < len(buf) else b""


async def connect(host: str, port: int) -> Connection:
    return (await asyncio.get_running_loop().create_connection(Connection, host, port))[1]


def _usage_tokens(tail: bytes) -> int | None:
    """completion_tokens of the usage event (choices: []) in the body's tail; None without one."""
    at = tail.rfind(b'data: {', 0, max(0, tail.rfind(b"data: [DONE]")))
    if at < 0 or b'"choices":[]' not in tail[at:]:
        return None
    event = tail[at + 6:].split(b"\n\n", 1)[0]
    return json.loads(event)["usage"]["completion_tokens"]


@dataclass
class Target:
    """What the streams send: bodies with SALT (and the tokens each must yield), filled per request from `salts`."""

    host: str
    port: int
    path: str
    payloads: list[tuple[bytes, int]]  # (body, its exact completion tokens)
    probe: bytes  # the max_tokens=1 body
    salts: list[bytes]  # three of them, joined by sep, make each request's prompt start unique
    sep: bytes
    lead: int  # events before the first token's (chat: the role chunk)

    def head(self, body: bytes) -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" \
            % (self.path.encode(), len(body)) + body

    def salted(self, body: bytes, key: int) -> bytes:
        n = len(self.salts)
        return body.replace(SALT, self.sep.join(self.salts[(key // n**i) % n] for i in range(3)))


async def _stream(target: Target, job: Job, g: int, keys, out: Result) -> None:
    """One closed-loop stream (global index g) until the window ends."""
    lo, hi = job.window
    await asyncio.sleep(max(0.0, job.start + g / job.num_streams * job.stagger - time.monotonic()))
    conn = await connect(target.host, target.port)
    j = 0
    try:
        while (sent := time.monotonic()) < hi:
            times: list[float] = []
            body, expected = target.payloads[(g + j * job.num_streams) % len(target.payloads)]
            j += 1
            try:
                status, tail = await asyncio.wait_for(conn.request(target.head(target.salted(body, next(keys))), times),
                                                      max(0.0, job.cut - time.monotonic()))
            except TimeoutError:  # its token events in the window still count, one token each (no usage)
                out.num_cut += 1
                marks = times[target.lead:]
                out.window_tokens += bisect.bisect_right(marks, hi) - bisect.bisect_left(marks, lo)
                break
            except (OSError, ValueError) as e:
                out.errors.append(f"broken stream: {e!r}"[:200])
                conn.transport.close()
                conn = await connect(target.host, target.port)
                continue
            tokens = _usage_tokens(tail) if status == 200 and tail.endswith(b"data: [DONE]\n\n") else None
            if tokens is None or b'data: {"error"' in tail:
                out.errors.append(f"status {status}: {tail[-200:]!r}")
                continue
            if tokens != expected:
                out.errors.append(f"{tokens} tokens, {expected} asked (ignore_eos)")
            out.num_tokens += tokens
            # token events: not chat's role chunk (lead), not the usage event and [DONE] at the end
            marks = times[target.lead:len(times) - 2]
            if marks:
                n_in = bisect.bisect_right(marks, hi) - bisect.bisect_left(marks, lo)
                out.window_tokens += n_in * tokens / len(marks)
            if lo <= sent and marks:
                out.num_requests += 1
                out.ttft.append(times[0] - sent)
                out.itl.extend(b - a for a, b in zip(marks, marks[1:]))
                out.e2e.append(times[-1] - sent)
    finally:
        conn.transport.close()


async def _probe(target: Target, job: Job, keys, out: Result) -> None:
    """A max_tokens=1 request every job.probe_every seconds of the window: the TTFT a newcomer sees under load."""
    lo, hi = job.window
    conn = await connect(target.host, target.port)
    try:
        for k in range(int((hi - lo) / job.probe_every)):
            await asyncio.sleep(max(0.0, lo + k * job.probe_every - time.monotonic()))
            t0 = time.monotonic()
            times: list[float] = []
            status, tail = await conn.request(target.head(target.salted(target.probe, next(keys))), times)
            if status == 200 and times and tail.endswith(b"data: [DONE]\n\n"):
                out.probe_ttft.append(times[0] - t0)
            else:
                out.errors.append(f"probe status {status}: {tail[-200:]!r}")
    finally:
        conn.transport.close()


def _worker(rank: int, num_procs: int, target: Target, jobs, results) -> None:
    keys = iter(range(rank, 1 << 60, num_procs))  # salt keys: disjoint across processes and levels

    async def level(job: Job) -> Result:
        out = Result()
        tasks = [_stream(target, job, g, keys, out) for g in job.streams]
        if job.probe_every:
            tasks.append(_probe(target, job, keys, out))
        for r in await asyncio.gather(*tasks, return_exceptions=True):
            if isinstance(r, BaseException):
                out.errors.append(f"stream task: {r!r}"[:200])
        return out

    while (job := jobs.get()) is not None:
        cpu, wall = time.process_time(), time.monotonic()
        out = asyncio.run(level(job))
        out.cpu_s, out.wall_s = time.process_time() - cpu, time.monotonic() - wall
        results.put(out)


class LoadPool:
    """Client processes (spawned once, kept across levels); start() and collect() drive one level."""

    def __init__(self, target: Target, num_procs: int):
        ctx = multiprocessing.get_context("spawn")
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(num_procs)]
        self.procs = [ctx.Process(target=_worker, args=(r, num_procs, target, q, self.results), daemon=True)
                      for r, q in enumerate(self.jobs)]
        for p in self.procs:
            p.start()

    def start(self, num_streams: int, warm: float, seconds: float, grace: float,
              probe_every: float) -> tuple[float, float]:
        """Start a level: the streams' starts spread over `warm`, then the measured window (returned) with a probe
        every `probe_every` seconds; requests still running `grace` seconds after it are cut."""
        start = time.monotonic() + 1.0  # every process has read its job by then
        window = (start + warm, start + warm + seconds)
        n = len(self.procs)
        for r, q in enumerate(self.jobs):
            q.put(Job(list(range(r, num_streams, n)), num_streams, start, warm, window, window[1] + grace,
                      probe_every=probe_every if r == 0 else 0.0))
        return window

    def collect(self) -> Result:
        """Wait for the level's end (every in-flight request finished) and merge the processes' results."""
        out = Result()
        for _ in self.jobs:
            out.merge(get_from(self.results, self.procs))
        return out

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for p in self.procs:
            p.join(timeout=10)


def get_from(queue, procs: list) -> object:
    """queue.get(), but an exit of any of `procs` (a crash) ends the wait instead of hanging the benchmark."""
    while True:
        try:
            return queue.get(timeout=2.0)
        except Empty:
            if dead := [p for p in procs if not p.is_alive()]:
                raise SystemExit(f"a benchmark process exited with {dead[0].exitcode}") from None


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# --- the self-check: a fake SSE server, one event per stream per tick (as an engine step delivers them) ----


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _fake_server(port: int, num_events: int, tick: float) -> None:
    """Every `tick` seconds one event (its own write, so its own TCP segment) to every open reply."""
    event = _chunk(b'data: {"choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]}\n\n')
    end = _chunk(b'data: {"choices":[],"usage":{"completion_tokens":%d}}\n\n' % num_events) \
        + _chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    live: dict = {}  # writer -> [events left, future]

    async def handle(reader, writer):
        try:
            while True:
                header = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(header.lower().split(b"content-length:")[1].split(b"\r\n")[0]))
                writer.write(head)
                done = asyncio.get_running_loop().create_future()
                live[writer] = [num_events, done]
                await done
        except (asyncio.IncompleteReadError, ConnectionError):
            live.pop(writer, None)
            writer.close()

    async def ticker():
        while True:
            await asyncio.sleep(tick)
            for writer, state in list(live.items()):
                state[0] -= 1
                writer.write(event if state[0] else event + end)
                if not state[0]:
                    del live[writer]
                    state[1].set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await asyncio.gather(server.serve_forever(), ticker())


def _run_fake(port: int, num_events: int, tick: float) -> None:
    asyncio.run(_fake_server(port, num_events, tick))


def main() -> None:
    import argparse
    import socket

    parser = argparse.ArgumentParser(description="events/s the load client sustains against a fake SSE server")
    parser.add_argument("--procs", type=int, default=1)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--events", type=int, default=128, help="token events per reply")
    parser.add_argument("--tick", type=float, default=0.01, help="seconds between a stream's events")
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = multiprocessing.get_context("spawn").Process(target=_run_fake, args=(port, args.events, args.tick),
                                                             daemon=True)
    server.start()
    time.sleep(1.0)
    pool = LoadPool(Target("127.0.0.1", port, "/v1/completions", [(b'{"prompt":[@@SALT@@]}', args.events)], b"{}",
                           [b"1"], b",", 0), args.procs)
    try:
        pool.start(args.streams, 0.5, args.seconds, 10.0, 0.0)
        r = pool.collect()
    finally:
        pool.close()
        server.terminate()
    print(f"{args.procs} client process(es), {args.streams} streams: {r.window_tokens / args.seconds:,.0f} "
          f"events/s (the fake offers {args.streams / args.tick:,.0f}), {r.num_requests} requests; client CPU "
          f"{r.cpu_s / r.num_tokens * 1e6:.1f} us per event (one process could take ~{r.num_tokens / r.cpu_s:,.0f} "
          f"events/s), {len(r.errors)} errors {r.errors[:2]}")


if __name__ == "__main__":
    main()
