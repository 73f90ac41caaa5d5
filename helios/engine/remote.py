"""The engine behind a Unix socket: one engine process, several HTTP frontend processes.

`EngineServer` runs in the engine process beside AsyncEngine: a thread accepts frontend connections, a reader
thread per connection turns frames into inbox commands, and each connection is an AsyncEngine Channel, so a round's
verdicts and outputs for that frontend leave as one frame (a non-blocking send from the engine thread; what the
socket does not take waits for the connection's writer thread, so a slow frontend never stalls the step loop).
`EngineClient` is the frontend's engine handle (submit, abort, metrics, health, shutdown, as AsyncEngine's) on
its asyncio loop: one reader task fans each round out to the per-request queues.
Frames: a 4-byte little-endian length, then one msgpack message of the tagged union below (data only; every
payload is a helios.engine.messages Struct). Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Literal

import msgspec
from msgspec import Struct

from helios.engine.async_engine import AsyncEngine, EngineUnavailable, read_stream
from helios.engine.engine_core import EngineMetrics
from helios.engine.messages import EngineOutput, EngineRequest, FrontendStats
from helios.engine.scheduler import QueueFull

__all__ = ["EngineClient", "EngineServer"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
MAX_FRAME_BYTES = 1 << 30
Refusal = Literal["queue_full", "invalid", "unavailable"]


# --- the wire: frontend -> engine ------------------------------------------------------------------


class Submit(Struct, frozen=True, tag="submit"):
    request: EngineRequest


class Abort(Struct, frozen=True, tag="abort"):
    req_id: str
    deliver: bool = True  # False: the consumer left, nothing is sent back


class Query(Struct, frozen=True, tag="query"):
    """Ask for the engine's metrics and every frontend's summed counters; `stats` are the asker's, fresh."""

    token: int
    stats: FrontendStats


class Report(Struct, frozen=True, tag="stats"):
    """A frontend's counters, sent now and then so the others' /metrics sum them."""

    stats: FrontendStats


# --- the wire: engine -> frontend ------------------------------------------------------------------


class Verdict(Struct, frozen=True, array_like=True):
    req_id: str
    refusal: Refusal | None = None  # None: admitted
    message: str = ""


class Round(Struct, frozen=True, tag="round"):
    """One step boundary's verdicts, then outputs, for one frontend; `error`: the engine's health after it."""

    verdicts: list[Verdict] = []
    outputs: list[EngineOutput] = []
    error: str | None = None


class Metrics(Struct, frozen=True, tag="metrics"):
    token: int
    metrics: EngineMetrics
    frontends: FrontendStats  # every frontend's counters summed (the asker's as sent)
    error: str | None = None


class Ready(Struct, frozen=True, tag="ready"):
    """The engine is warm: the frontend may start serving."""

    error: str | None = None


ToEngine = Submit | Abort | Query | Report
ToFrontend = Round | Metrics | Ready


def _frame(encoder: msgspec.msgpack.Encoder, message) -> bytes:
    payload = encoder.encode(message)
    return _HEADER.pack(len(payload)) + payload


def _refusal(error: BaseException) -> tuple[Refusal, str]:
    if isinstance(error, QueueFull):
        return "queue_full", str(error)
    if isinstance(error, ValueError):
        return "invalid", str(error)
    return "unavailable", str(error) or type(error).__name__


def _exception(verdict: Verdict) -> BaseException:
    if verdict.refusal == "queue_full":
        return QueueFull(verdict.message)
    if verdict.refusal == "invalid":
        return ValueError(verdict.message)
    return EngineUnavailable(verdict.message)


def sum_stats(parts: list[FrontendStats]) -> FrontendStats:
    return FrontendStats(
        http_requests=sum(p.http_requests for p in parts),
        admission_slots=sum(p.admission_slots for p in parts),
        admission_in_use=sum(p.admission_in_use for p in parts),
        first_response=sorted(x for p in parts for x in p.first_response),
    )


# --- the engine process ----------------------------------------------------------------------------


class _RemoteSink:
    __slots__ = ("channel", "req_id")

    def __init__(self, channel: _Connection, req_id: str) -> None:
        self.channel = channel
        self.req_id = req_id


class _Connection:
    """One frontend process: an AsyncEngine Channel (engine thread) plus its reader and writer threads."""

    def __init__(self, server: EngineServer, sock: socket.socket, index: int) -> None:
        self.server, self.sock, self.index = server, sock, index
        self.sinks: dict[str, _RemoteSink] = {}  # submitted, not yet finished or refused
        self.stats = FrontendStats()
        self.stats_at = time.monotonic()
        self.has_reported = False
        self.is_alive = True
        self._verdicts: list[Verdict] = []
        self._outputs: list[EngineOutput] = []
        self._encoder = msgspec.msgpack.Encoder()  # engine thread's; the reader thread has its own
        self._lock = threading.Lock()  # the socket's send side and the backlog
        self._backlog = bytearray()
        self._is_writing = False
        self._has_backlog = threading.Condition(self._lock)
        threading.Thread(target=self._read, name=f"helios-frontend-{index}-reader", daemon=True).start()
        threading.Thread(target=self._write, name=f"helios-frontend-{index}-writer", daemon=True).start()

    # Channel (the engine thread)
    def push(self, sink: _RemoteSink, output: EngineOutput) -> None:
        if output.finished and self.sinks.get(output.req_id) is sink:
            del self.sinks[output.req_id]
        self._outputs.append(output)

    def settle(self, sink: _RemoteSink, error: BaseException | None) -> None:
        if error is None:
            self._verdicts.append(Verdict(sink.req_id))
            return
        if self.sinks.get(sink.req_id) is sink:
            del self.sinks[sink.req_id]
        self._verdicts.append(Verdict(sink.req_id, *_refusal(error)))

    def flush(self) -> bool:
        if not self.is_alive:
            return False
        if self._verdicts or self._outputs:
            round_ = Round(verdicts=self._verdicts, outputs=self._outputs, error=self.server.engine.error)
            self._verdicts, self._outputs = [], []
            self.send(_frame(self._encoder, round_))
        return self.is_alive

    # any thread
    def send(self, frame: bytes) -> None:
        """Send without blocking: what the socket does not take now goes to the writer thread, in order."""
        with self._lock:
            if not self.is_alive:
                return
            if self._backlog or self._is_writing:
                self._backlog += frame
                self._has_backlog.notify()
                return
            try:
                sent = self.sock.send(frame, socket.MSG_DONTWAIT)
            except BlockingIOError:
                sent = 0
            except OSError:
                self.is_alive = False
                return
            if sent < len(frame):
                self._backlog += frame[sent:]
                self._has_backlog.notify()

    def _write(self) -> None:
        while True:
            with self._lock:
                while self.is_alive and not self._backlog:
                    self._has_backlog.wait()
                if not self.is_alive:
                    return
                data, self._backlog = bytes(self._backlog), bytearray()
                self._is_writing = True
            try:
                self.sock.sendall(data)
            except OSError:
                self.close()
                return
            finally:
                with self._lock:
                    self._is_writing = False

    def _read(self) -> None:
        decoder = msgspec.msgpack.Decoder(ToEngine)
        encoder = msgspec.msgpack.Encoder()
        try:
            while True:
                header = _recv_exactly(self.sock, _HEADER.size)
                if header is None:
                    return
                (size,) = _HEADER.unpack(header)
                if size > MAX_FRAME_BYTES:
                    logger.error("frontend %d sent a %d-byte frame; closing it", self.index, size)
                    return
                payload = _recv_exactly(self.sock, size)
                if payload is None:
                    return
                message = decoder.decode(payload)
                engine = self.server.engine  # NOTE: set before Ready, and frontends send nothing before Ready
                if isinstance(message, Submit):
                    req_id = message.request.req_id
                    sink = _RemoteSink(self, req_id)
                    self.sinks[req_id] = sink
                    try:
                        engine.post_add(message.request, sink)
                    except EngineUnavailable as e:
                        self.sinks.pop(req_id, None)
                        self.send(_frame(encoder, Round(verdicts=[Verdict(req_id, *_refusal(e))],
                                                        error=engine.error)))
                elif isinstance(message, Abort):
                    sink = self.sinks.get(message.req_id)
                    if sink is not None:
                        if not message.deliver:
                            del self.sinks[message.req_id]
                        engine.post_abort(message.req_id, sink, message.deliver)
                elif isinstance(message, Query):
                    self._note(message.stats)
                    self.send(_frame(encoder, Metrics(token=message.token, metrics=engine.metrics(),
                                                      frontends=self.server.frontend_stats(), error=engine.error)))
                else:
                    if not self.has_reported:
                        self.has_reported = True
                        self.server._note_up()
                    self._note(message.stats)
        except (OSError, msgspec.DecodeError) as e:
            if self.is_alive:
                logger.error("frontend %d connection failed: %s", self.index, e)
        finally:
            self.close()
            self.server.lost(self)

    def _note(self, stats: FrontendStats) -> None:
        self.stats, self.stats_at = stats, time.monotonic()

    def close(self) -> None:
        with self._lock:
            self.is_alive = False
            self._has_backlog.notify()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """n bytes, or None at a clean end of stream before the first of them."""
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            if buf:
                raise OSError("the connection closed inside a frame")
            return None
        buf += chunk
    return bytes(buf)


class EngineServer:
    """Accepts frontend connections on a Unix socket path at once (they wait for Ready) and serves them from the
    engine given to start() until close()."""

    def __init__(self, path: str) -> None:
        self.engine: AsyncEngine | None = None
        self.path = path
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(64)
        self._connections: list[_Connection] = []
        self._lock = threading.Lock()
        self._ready: Ready | None = None  # set by mark_ready: sent to every connection, present and future
        self._closed = False
        self._num_up = 0  # connections that reported their counters: their HTTP server is up
        self.last_up_at: float | None = None  # time.monotonic() of the latest report of a frontend up (start-up split)
        self._up = threading.Condition(self._lock)
        threading.Thread(target=self._accept, name="helios-engine-listener", daemon=True).start()

    def start(self, engine: AsyncEngine) -> None:
        """The engine to serve; frontends send nothing before mark_ready()."""
        self.engine = engine

    def frontends_up(self, count: int, timeout: float) -> bool:
        """Wait up to timeout for `count` frontends to have reported (their HTTP servers are up)."""
        with self._up:
            return self._up.wait_for(lambda: self._num_up >= count, timeout)

    def _note_up(self) -> None:
        with self._up:
            self._num_up += 1
            self.last_up_at = time.monotonic()
            self._up.notify_all()

    def mark_ready(self, error: str | None = None) -> None:
        """The engine is warm (or failed to start: error): tell every frontend, now and on connect."""
        with self._lock:
            self._ready = Ready(error=error)
            connections = list(self._connections)
        for conn in connections:
            conn.send(_frame(msgspec.msgpack.Encoder(), self._ready))

    def frontend_stats(self) -> FrontendStats:
        """Every live frontend's latest counters, summed; first-response samples older than the window dropped."""
        with self._lock:
            parts = [(c.stats, c.stats_at) for c in self._connections if c.is_alive]
        now = time.monotonic()
        aged = []
        for stats, at in parts:
            shift = now - at
            samples = [(age + shift, s) for age, s in stats.first_response]
            aged.append(msgspec.structs.replace(stats, first_response=samples))
        return sum_stats(aged)

    def lost(self, conn: _Connection) -> None:
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
            if conn.has_reported:
                self._num_up -= 1
        # its live requests go at the next step boundary (the engine thread alone touches the scheduler)
        engine = self.engine
        if engine is not None:
            engine.post_call(lambda: engine.drop_channel(conn))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            connections = list(self._connections)
        try:
            self._listener.close()
        except OSError:
            pass
        for conn in connections:
            conn.close()

    def _accept(self) -> None:
        index = 0
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                conn = _Connection(self, sock, index)
                self._connections.append(conn)
                ready = self._ready
            index += 1
            if ready is not None:
                conn.send(_frame(msgspec.msgpack.Encoder(), ready))


# --- a frontend process ----------------------------------------------------------------------------


class _Stream:
    __slots__ = ("queue", "accepted")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.accepted: asyncio.Future = loop.create_future()


class EngineClient:
    """The engine handle of a frontend process (AsyncEngine's interface over the socket), on one asyncio loop.

    connect() returns once the engine said it is ready; on_lost runs (on the loop) when the engine's
    connection ends, after every open stream was ended with "error"."""

    def __init__(self, path: str, on_lost: Callable[[], None] | None = None) -> None:
        self.path = path
        self.on_lost = on_lost
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._streams: dict[str, _Stream] = {}
        self._queries: dict[int, asyncio.Future] = {}
        self._next_token = 0
        self._metrics: EngineMetrics | None = None
        self._frontends = FrontendStats()
        self._engine_error: str | None = None
        self._lost: str | None = "not connected to the engine"
        self._ready: asyncio.Future | None = None

    async def connect(self, timeout: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        reader, self._writer = await asyncio.open_unix_connection(self.path, limit=1 << 20)
        self._lost = None
        self._ready = loop.create_future()
        self._reader_task = loop.create_task(self._read(reader))
        ready: Ready = await asyncio.wait_for(asyncio.shield(self._ready), timeout)
        if ready.error is not None:
            raise EngineUnavailable(ready.error)

    # --- AsyncEngine's interface ------------------------------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return self._lost is None and self._engine_error is None

    @property
    def error(self) -> str | None:
        return self._lost or self._engine_error

    def metrics(self) -> EngineMetrics:
        """The engine's counters as of the latest refresh_metrics()."""
        if self._metrics is None:
            raise EngineUnavailable("no metrics from the engine yet")
        return self._metrics

    async def refresh_metrics(self, stats: FrontendStats) -> FrontendStats:
        """Fetch the engine's metrics now (then metrics() returns them) with every frontend's counters summed,
        this one's being `stats`."""
        if self._lost is not None:
            raise EngineUnavailable(self._lost)
        token, self._next_token = self._next_token, self._next_token + 1
        future = self._queries[token] = asyncio.get_running_loop().create_future()
        self._send(Query(token=token, stats=stats))
        try:
            reply: Metrics = await future
        finally:
            self._queries.pop(token, None)
        self._metrics, self._frontends = reply.metrics, reply.frontends
        return reply.frontends

    def report(self, stats: FrontendStats) -> None:
        """Send this frontend's counters (for the other frontends' /metrics)."""
        if self._lost is None:
            self._send(Report(stats=stats))

    async def submit(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if not self.is_healthy:
            raise EngineUnavailable(self.error or "the engine is unavailable")
        req_id = request.req_id
        if req_id in self._streams:
            raise ValueError(f"request {req_id!r} is already active")
        stream = self._streams[req_id] = _Stream(asyncio.get_running_loop())
        try:
            self._send(Submit(request=request))
            await stream.accepted
        except BaseException:
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]
            if not stream.accepted.done() or stream.accepted.cancelled():
                self._send(Abort(req_id=req_id, deliver=False))
            raise
        return self._consume(req_id, stream)

    def abort(self, req_id: str) -> None:
        if req_id in self._streams and self._lost is None:  # a lost engine already ended every stream
            self._send(Abort(req_id=req_id))

    def shutdown(self) -> None:
        """Close the connection (the engine aborts what this frontend left running)."""
        self._lost = self._lost or "the frontend is shut down"
        if self._writer is not None:
            self._writer.close()
        if self._reader_task is not None:
            self._reader_task.cancel()

    # --- internals ------------------------------------------------------------------------------

    def _send(self, message) -> None:
        if self._writer is None or self._lost is not None:
            raise EngineUnavailable(self._lost or "not connected to the engine")
        self._writer.write(_frame(self._encoder, message))

    def _consume(self, req_id: str, stream: _Stream) -> AsyncIterator[EngineOutput]:
        def abandon() -> None:
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]
                if self._lost is None:
                    self._send(Abort(req_id=req_id, deliver=False))

        return read_stream(stream.queue, abandon)

    async def _read(self, reader: asyncio.StreamReader) -> None:
        decoder = msgspec.msgpack.Decoder(ToFrontend)
        why = "the engine process closed its connection"
        try:
            while True:
                header = await reader.readexactly(_HEADER.size)
                (size,) = _HEADER.unpack(header)
                message = decoder.decode(await reader.readexactly(size))
                if isinstance(message, Round):
                    self._engine_error = message.error
                    self._apply(message)
                elif isinstance(message, Metrics):
                    self._engine_error = message.error
                    future = self._queries.get(message.token)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif self._ready is not None and not self._ready.done():
                    self._ready.set_result(message)
        except asyncio.CancelledError:
            why = self._lost or "the frontend is shut down"
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            pass
        except msgspec.DecodeError as e:
            why = f"undecodable message from the engine: {e}"
            logger.error("%s", why)
        self._fail_all(why)

    def _apply(self, round_: Round) -> None:
        streams = self._streams
        for verdict in round_.verdicts:
            stream = streams.get(verdict.req_id)
            if stream is None or stream.accepted.done():
                continue
            if verdict.refusal is None:
                stream.accepted.set_result(None)
            else:
                del streams[verdict.req_id]
                stream.accepted.set_exception(_exception(verdict))
        for output in round_.outputs:
            stream = streams.get(output.req_id)
            if stream is None or not stream.accepted.done():
                # NOTE: before its verdict, an id's outputs are an earlier submission's (left, aborted after them)
                continue
            if output.finished:
                del streams[output.req_id]
            stream.queue.put_nowait(output)

    def _fail_all(self, why: str) -> None:
        self._lost = why
        streams, self._streams = self._streams, {}
        for req_id, stream in streams.items():
            if not stream.accepted.done():
                stream.accepted.set_exception(EngineUnavailable(why))
            else:
                stream.queue.put_nowait(EngineOutput(req_id=req_id, finished=True, finish_reason="error", error=why))
        for future in self._queries.values():
            if not future.done():
                future.set_exception(EngineUnavailable(why))
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(EngineUnavailable(why))
        if self.on_lost is not None:
            self.on_lost()
