"""AsyncEngine: runs EngineCore's step loop on its own thread and streams outputs to its consumers.

Owns the engine thread, the inbox (adds and aborts from any thread, drained by the engine thread at step
boundaries), the published metrics, the idle wait (a condition variable: no busy-wait) and delivery: a round's
verdicts and outputs go out per consumer channel in one hand-over (one loop.call_soon_threadsafe per asyncio
loop of this process; one frame per frontend process, helios/engine/remote.py), never a wake per token.
NOTE: only the engine thread touches the EngineCore, its scheduler and its constraint owner, so schedule() and
the token masks it asks for run under no lock another thread takes; the inbox's lock is held only to append or
take commands. Knows nothing about HTTP or tokenization.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from helios.engine.engine_core import EngineCore, EngineMetrics
from helios.engine.messages import AbortRequest, EngineOutput, EngineRequest
from helios.engine.scheduler import QueueFull

__all__ = ["AsyncEngine", "Channel", "EngineMetrics", "EngineUnavailable", "QueueFull", "Sink"]

logger = logging.getLogger(__name__)
BACKGROUND_INTERVAL_S = 0.5  # under load: seconds between units of the runner's deferred work


class EngineUnavailable(RuntimeError):
    """The engine is shut down or unhealthy (the server answers 503)."""


class Channel(Protocol):
    """Where a round's verdicts and outputs for some requests go; called on the engine thread only. push and
    settle buffer; flush hands the round over at once and returns False when the consumer is gone (its live
    requests are then aborted)."""

    def push(self, sink: Sink, output: EngineOutput) -> None: ...

    def settle(self, sink: Sink, error: BaseException | None) -> None: ...

    def flush(self) -> bool: ...


class Sink(Protocol):
    """One submission's consumer: `channel` is how its round reaches it (identity tells a reused req_id's
    submissions apart)."""

    channel: Channel


class _LoopChannel:
    """An asyncio loop of this process: a round's settles and queue puts run in one call_soon_threadsafe."""

    __slots__ = ("loop", "_calls")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._calls: list[tuple[Callable, object]] = []

    def push(self, sink: _Stream, output: EngineOutput) -> None:
        self._calls.append((sink.queue.put_nowait, output))

    def settle(self, sink: _Stream, error: BaseException | None) -> None:
        self._calls.append((sink.settle, error))

    def flush(self) -> bool:
        calls, self._calls = self._calls, []
        if not calls:
            return True
        try:
            self.loop.call_soon_threadsafe(_run_calls, calls)
            return True
        except RuntimeError:  # the loop is closed: nobody is listening
            return False


async def read_stream(queue: asyncio.Queue[EngineOutput], abandon: Callable[[], None]) -> AsyncIterator[EngineOutput]:
    """A submission's outputs from its queue through the terminal one; abandon() runs when the consumer leaves
    before it (aclose, or the generator collected)."""
    is_done = False
    try:
        while True:
            output = await queue.get()
            is_done = output.finished
            yield output
            if is_done:
                return
    finally:
        if not is_done:
            abandon()


def _run_calls(calls: list[tuple[Callable, object]]) -> None:
    for fn, arg in calls:
        fn(arg)


class _Stream:
    """A submission from an asyncio loop of this process: its queue and the future its admission settles."""

    __slots__ = ("channel", "queue", "accepted")

    def __init__(self, channel: _LoopChannel) -> None:
        self.channel = channel
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.accepted: asyncio.Future = channel.loop.create_future()

    def settle(self, error: BaseException | None) -> None:  # on its loop
        if not self.accepted.done():
            self.accepted.set_result(None) if error is None else self.accepted.set_exception(error)


@dataclass
class _Add:
    request: EngineRequest
    sink: Sink


@dataclass
class _Abort:
    message: AbortRequest
    sink: Sink | None = None  # only this submission; None: whichever is live under the id
    deliver: bool = True  # False: its consumer left, nothing is delivered


class AsyncEngine:
    def __init__(self, core: EngineCore, *, name: str = "helios-engine", own_thread: bool = True) -> None:
        """own_thread: start the step loop on a new thread; False: the caller runs it with run() (on CPU, the thread
        that built the runner: a second thread's OpenMP team makes every parallel region's wake-up slower)."""
        self.core = core
        self._cv = threading.Condition()  # guards the inbox and _is_stopping; the engine thread idles on it
        self._inbox: deque[_Add | _Abort | Callable[[], None]] = deque()
        self._is_stopping = False
        self._fatal_error: str | None = None  # the loop itself crashed (a scheduler bug)
        self._streams: dict[str, _Stream] = {}  # this process's submissions not yet finished or abandoned
        self._streams_lock = threading.Lock()
        self._channels: dict[asyncio.AbstractEventLoop, _LoopChannel] = {}  # guarded by _streams_lock
        self._live: dict[str, Sink] = {}  # engine thread only: the sink each admitted request delivers to
        self._metrics = core.metrics()  # published by the engine thread after each round, before its outputs
        self._is_done = threading.Event()  # the step loop has returned (or never will run: see shutdown)
        self._is_running = threading.Event()  # the step loop has started
        self._loop_thread: threading.Thread | None = None
        if own_thread:
            self._is_running.set()
            threading.Thread(target=self.run, name=name, daemon=True).start()

    # --- public API (any thread / the event loop) ---------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return (
            not self._is_stopping
            and self._fatal_error is None
            and self.core.is_healthy
            and not self._is_done.is_set()
        )

    @property
    def error(self) -> str | None:
        return self._fatal_error or self.core.error

    def metrics(self) -> EngineMetrics:
        """The engine's counters as of its latest round (a request's terminal output is already counted)."""
        return self._metrics

    async def submit(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Hand the request to the engine thread and return its output stream once admitted (raising QueueFull,
        ValueError or EngineUnavailable as the scheduler decides at the next step boundary).

        The stream ends after the terminal output; closing it early (aclose, or a dropped consumer being
        collected) aborts the request.
        """
        if not self.is_healthy:
            raise EngineUnavailable(self.error or "the engine is shut down")
        loop = asyncio.get_running_loop()
        req_id = request.req_id
        with self._streams_lock:
            if req_id in self._streams:
                raise ValueError(f"request {req_id!r} is already active")
            channel = self._channels.get(loop)
            if channel is None:
                for closed in [lp for lp in self._channels if lp.is_closed()]:
                    del self._channels[closed]
                channel = self._channels[loop] = _LoopChannel(loop)
            stream = self._streams[req_id] = _Stream(channel)
        try:
            # NOTE: the engine thread is woken on the loop's next turn, so the choices of a group submitted together
            # (asyncio.gather) reach the same inbox round
            self.post_add(request, stream, wake=False)
            loop.call_soon(self._wake)
            await stream.accepted
        except BaseException:  # refused, unavailable, or the submitter was cancelled while waiting
            self._forget(req_id, stream)
            if not stream.accepted.done() or stream.accepted.cancelled():
                self.post_abort(req_id, stream, deliver=False)
            raise
        return self._consume(req_id, stream)

    def abort(self, req_id: str) -> None:
        """Cancel a request from any thread: at the next step boundary its pages are freed and its stream ends
        with "abort" (tokens of a step running now are not delivered)."""
        self.post_abort(req_id)

    def post_add(self, request: EngineRequest, sink: Sink, wake: bool = True) -> None:
        """Queue an admission for the next step boundary; its verdict reaches sink.channel.settle (a refusal:
        QueueFull, ValueError or EngineUnavailable). Raises EngineUnavailable when the engine is stopped."""
        self._post(_Add(request, sink), wake=wake)

    def post_abort(self, req_id: str, sink: Sink | None = None, deliver: bool = True) -> None:
        """Queue an abort: of `sink`'s submission only (None: whichever is live under the id); deliver=False when
        its consumer left (nothing is sent)."""
        self._post(_Abort(AbortRequest(req_id=req_id), sink, deliver), quiet=True)

    def post_call(self, fn: Callable[[], None]) -> None:
        """Run fn on the engine thread at the next step boundary (a frontend connection that closed)."""
        self._post(fn, quiet=True)

    def drop_channel(self, channel: Channel) -> None:
        """Engine thread: abort every live request that delivers to `channel` (its consumer is gone)."""
        for req_id, sink in list(self._live.items()):
            if sink.channel is channel:
                del self._live[req_id]
                self._forget(req_id, sink)
                self.core.abort(req_id)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after the current step, wait for it to return, and end every open stream with "abort"."""
        with self._cv:
            self._is_stopping = True
            self._cv.notify_all()
        if self._loop_thread is threading.current_thread():
            pass  # called from the loop itself: it returns after this
        elif self._is_running.is_set():
            self._is_done.wait(timeout)
        else:  # the loop never started (run() was never called): nothing runs the core
            self._is_done.set()
        if not self._is_done.is_set():  # a step that never returns: end this process's streams, leave the core alone
            with self._streams_lock:
                streams = list(self._streams.items())
            for req_id, stream in streams:
                stream.channel.push(stream, EngineOutput(req_id=req_id, finished=True, finish_reason="abort"))
                stream.channel.flush()
            return
        self._fail_inbox(EngineUnavailable("the engine is shut down"))
        outputs = []
        for req_id in list(self._live):
            outputs.append(self.core.abort(req_id) or EngineOutput(req_id=req_id, finished=True, finish_reason="abort"))
        self._metrics = self.core.metrics()
        self._deliver([], outputs)

    # --- any thread ------------------------------------------------------------------------------

    def _post(self, command, quiet: bool = False, wake: bool = True) -> None:
        """Append to the inbox and wake the engine thread (or leave that to the caller); an add to a stopped
        engine is refused (quiet: ignored)."""
        with self._cv:
            if self._is_stopping or self._fatal_error is not None:
                if quiet:
                    return
                raise EngineUnavailable(self.error or "the engine is shut down")
            self._inbox.append(command)
            if wake:
                self._cv.notify()

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _forget(self, req_id: str, stream: Sink) -> None:
        with self._streams_lock:
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]

    def _consume(self, req_id: str, stream: _Stream) -> AsyncIterator[EngineOutput]:
        def abandon() -> None:
            # the id is free for a new submission at once; the inbox's order aborts this one first
            self._forget(req_id, stream)
            self.post_abort(req_id, stream, deliver=False)

        return read_stream(stream.queue, abandon)

    # --- the engine thread ----------------------------------------------------------------------

    def run(self) -> None:
        """The step loop, on the calling thread, until shutdown() (started by the constructor when own_thread)."""
        self._loop_thread = threading.current_thread()
        self._is_running.set()
        try:
            self._run()
        finally:
            self._is_done.set()

    def _run(self) -> None:
        core = self.core
        next_background = 0.0  # under load, deferred runner work waits this long between units
        try:
            while True:
                with self._cv:
                    while (not self._is_stopping and not self._inbox and not core.has_unfinished_requests()
                           and not core.has_background_work):
                        self._cv.wait()
                    if self._is_stopping:
                        return
                    has_commands = bool(self._inbox)
                if has_commands:
                    self._finish_round([])  # admissions are answered before the step, not after it
                if core.has_unfinished_requests():
                    self._finish_round(core.step())
                # NOTE: deferred start-up work (a decode graph to capture, tens of ms) runs whenever the loop is
                # idle, and under load at most once per BACKGROUND_INTERVAL_S: each unit stalls the running streams
                if core.has_background_work and (not core.has_unfinished_requests()
                                                 or time.monotonic() >= next_background):
                    core.background_step()
                    next_background = time.monotonic() + BACKGROUND_INTERVAL_S
                    # NOTE: an idle server runs no round to publish the metrics after: /metrics read the captures
                    # left at start for as long as it idled (a load benchmark waited 60 s on them, session 21)
                    self._metrics = core.metrics()
        except Exception as exc:  # a bug in the engine itself: fail every stream, stay unhealthy
            logger.exception("engine loop crashed")
            self._fatal_error = f"engine loop crashed: {type(exc).__name__}: {exc}"
            self._fail_inbox(EngineUnavailable(self._fatal_error))
            live, self._live = self._live, {}  # every consumer is told below; shutdown leaves the broken core alone
            channels = {}
            for req_id, sink in live.items():
                sink.channel.push(sink, EngineOutput(req_id=req_id, finished=True, finish_reason="error",
                                                     error=self._fatal_error))
                channels[id(sink.channel)] = sink.channel
            with self._streams_lock:
                self._streams.clear()
            for channel in channels.values():
                channel.flush()

    def _finish_round(self, stepped: list[EngineOutput]) -> None:
        """Apply the inbox, publish the metrics, then answer the submitters and deliver the outputs."""
        settles, aborts, aborted = self._drain()
        # aborts that arrived during the step win over its tokens (as an abort mid-step always has); NOTE: the
        # filter also keeps them from a later submission of the same id admitted by this drain
        outputs = [o for o in stepped if o.req_id not in aborted] + aborts
        self._metrics = self.core.metrics()  # NOTE: before delivery, so a finished stream sees its counts
        self._deliver(settles, outputs)

    def _drain(self) -> tuple[list[tuple[Sink, BaseException | None]], list[EngineOutput], set[str]]:
        """Apply the inbox in arrival order: adds go to the scheduler (or are refused), aborts free pages now.
        Returns the adds' verdicts, the terminal records of aborts to deliver, and every aborted id."""
        with self._cv:
            commands, self._inbox = list(self._inbox), deque()
        settles: list[tuple[Sink, BaseException | None]] = []
        outputs: list[EngineOutput] = []
        aborted: set[str] = set()
        for command in commands:
            if isinstance(command, _Add):
                req_id = command.request.req_id
                try:
                    if req_id in self._live:  # another frontend's submission under the same id
                        raise ValueError(f"request {req_id!r} is already active")
                    self.core.add_request(command.request)
                except (QueueFull, ValueError) as exc:
                    settles.append((command.sink, exc))
                    continue
                self._live[req_id] = command.sink
                settles.append((command.sink, None))
                continue
            if not isinstance(command, _Abort):
                command()
                continue
            req_id = command.message.req_id
            live = self._live.get(req_id)
            if live is None or (command.sink is not None and command.sink is not live):
                continue  # finished already, or a later submission of the same id
            output = self.core.abort(req_id)
            aborted.add(req_id)
            if not command.deliver:  # its consumer left: nobody to tell
                del self._live[req_id]
            elif output is not None:
                outputs.append(output)
        return settles, outputs, aborted

    def _fail_inbox(self, error: BaseException) -> None:
        with self._cv:
            commands, self._inbox = list(self._inbox), deque()
        channels = {}
        for command in commands:
            if isinstance(command, _Add):
                command.sink.channel.settle(command.sink, error)
                channels[id(command.sink.channel)] = command.sink.channel
        for channel in channels.values():
            channel.flush()

    def _deliver(self, settles: list[tuple[Sink, BaseException | None]], outputs: list[EngineOutput]) -> None:
        """One hand-over per channel: the verdicts first, then the outputs, in order."""
        channels: dict[int, Channel] = {}
        for sink, error in settles:
            sink.channel.settle(sink, error)
            channels[id(sink.channel)] = sink.channel
        for output in outputs:
            sink = self._live.get(output.req_id)
            if sink is None:
                continue
            if output.finished:
                del self._live[output.req_id]
                self._forget(output.req_id, sink)
            sink.channel.push(sink, output)
            channels[id(sink.channel)] = sink.channel
        for channel in channels.values():
            if not channel.flush():  # the consumer is gone (its event loop closed): nobody is listening
                self.drop_channel(channel)
