"""AsyncEngine: runs EngineCore's step loop on its own thread and streams outputs to asyncio callers.

Owns the engine thread, the inbox (adds and aborts from any thread, drained by the engine thread at step
boundaries), the per-request asyncio queues (fed through loop.call_soon_threadsafe), the published metrics and the
idle wait (a condition variable: no busy-wait). NOTE: only the engine thread touches the EngineCore, its scheduler
and its constraint owner, so schedule() and the token masks it asks for run under no lock another thread takes; the
inbox's lock is held only to append or take commands. Knows nothing about HTTP or tokenization.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

from helios.engine.engine_core import EngineCore, EngineMetrics
from helios.engine.messages import AbortRequest, EngineOutput, EngineRequest
from helios.engine.scheduler import QueueFull

__all__ = ["AsyncEngine", "EngineMetrics", "EngineUnavailable", "QueueFull"]

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine is shut down or unhealthy (the server answers 503)."""


class _Stream:
    """One submission's consumer: its event loop and queue (identity tells a reused req_id's streams apart)."""

    __slots__ = ("loop", "queue")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()


@dataclass
class _Add:
    request: EngineRequest
    stream: _Stream
    accepted: asyncio.Future  # settled on the submitter's loop: None, or the refusal (QueueFull, ValueError)


@dataclass
class _Abort:
    message: AbortRequest
    stream: _Stream | None = None  # only this submission (a consumer that left; nothing is delivered); None: any


class AsyncEngine:
    def __init__(self, core: EngineCore, *, name: str = "helios-engine") -> None:
        self.core = core
        self._cv = threading.Condition()  # guards the inbox and _is_stopping; the engine thread idles on it
        self._inbox: deque[_Add | _Abort] = deque()
        self._is_stopping = False
        self._fatal_error: str | None = None  # the loop itself crashed (a scheduler bug)
        self._streams: dict[str, _Stream] = {}  # submitted and not yet finished or abandoned (the duplicate check)
        self._streams_lock = threading.Lock()
        self._live: dict[str, _Stream] = {}  # engine thread only: the stream each admitted request delivers to
        self._metrics = core.metrics()  # published by the engine thread after each round, before its outputs
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # --- public API (any thread / the event loop) ---------------------------------------------

    @property
    def is_healthy(self) -> bool:
        return (
            not self._is_stopping
            and self._fatal_error is None
            and self.core.is_healthy
            and self._thread.is_alive()
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
        stream = _Stream(loop)
        req_id = request.req_id
        with self._streams_lock:
            if req_id in self._streams:
                raise ValueError(f"request {req_id!r} is already active")
            self._streams[req_id] = stream
        accepted = loop.create_future()
        try:
            # NOTE: the engine thread is woken on the loop's next turn, so the choices of a group submitted together
            # (asyncio.gather) reach the same inbox round
            self._post(_Add(request, stream, accepted), wake=False)
            loop.call_soon(self._wake)
            await accepted
        except BaseException:  # refused, unavailable, or the submitter was cancelled while waiting
            self._forget(req_id, stream)
            if not accepted.done() or accepted.cancelled():
                self._post(_Abort(AbortRequest(req_id=req_id), stream), quiet=True)
            raise
        return self._consume(req_id, stream)

    def abort(self, req_id: str) -> None:
        """Cancel a request from any thread: at the next step boundary its pages are freed and its stream ends
        with "abort" (tokens of a step running now are not delivered)."""
        self._post(_Abort(AbortRequest(req_id=req_id)), quiet=True)

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after the current step, join the thread, and end every open stream with "abort"."""
        with self._cv:
            self._is_stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if self._thread.is_alive():  # a step that never returns: end the streams, leave the core alone
            with self._streams_lock:
                streams = list(self._streams.items())
            for req_id, stream in streams:
                self._send(stream, EngineOutput(req_id=req_id, finished=True, finish_reason="abort"))
            return
        self._fail_inbox(EngineUnavailable("the engine is shut down"))
        outputs = []
        for req_id in list(self._live):
            outputs.append(self.core.abort(req_id) or EngineOutput(req_id=req_id, finished=True, finish_reason="abort"))
        self._metrics = self.core.metrics()
        self._deliver(outputs)

    # --- the event loop's side ------------------------------------------------------------------

    def _post(self, command: _Add | _Abort, quiet: bool = False, wake: bool = True) -> None:
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

    def _forget(self, req_id: str, stream: _Stream) -> None:
        with self._streams_lock:
            if self._streams.get(req_id) is stream:
                del self._streams[req_id]

    async def _consume(self, req_id: str, stream: _Stream) -> AsyncIterator[EngineOutput]:
        is_done = False
        try:
            while True:
                output = await stream.queue.get()
                is_done = output.finished
                yield output
                if is_done:
                    return
        finally:
            if not is_done:
                # the id is free for a new submission at once; the inbox's order aborts this one first
                self._forget(req_id, stream)
                self._post(_Abort(AbortRequest(req_id=req_id), stream), quiet=True)

    # --- the engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._is_stopping and not self._inbox and not self.core.has_unfinished_requests():
                        self._cv.wait()
                    if self._is_stopping:
                        return
                with self._cv:
                    has_commands = bool(self._inbox)
                if has_commands:
                    self._finish_round([])  # admissions are answered before the step, not after it
                if self.core.has_unfinished_requests():
                    self._finish_round(self.core.step())
        except Exception as exc:  # a bug in the engine itself: fail every stream, stay unhealthy
            logger.exception("engine loop crashed")
            self._fatal_error = f"engine loop crashed: {type(exc).__name__}: {exc}"
            self._fail_inbox(EngineUnavailable(self._fatal_error))
            self._live.clear()  # every stream is told below; shutdown leaves the broken core alone
            with self._streams_lock:
                streams = list(self._streams.items())
            for req_id, stream in streams:
                self._send(stream, EngineOutput(req_id=req_id, finished=True, finish_reason="error",
                                                error=self._fatal_error))

    def _finish_round(self, stepped: list[EngineOutput]) -> None:
        """Apply the inbox, publish the metrics, then answer the submitters and deliver the outputs."""
        settles, aborts, aborted = self._drain()
        # aborts that arrived during the step win over its tokens (as an abort mid-step always has); NOTE: the
        # filter also keeps them from a later submission of the same id admitted by this drain
        outputs = [o for o in stepped if o.req_id not in aborted] + aborts
        self._metrics = self.core.metrics()  # NOTE: before delivery, so a finished stream sees its counts
        for add, error in settles:
            self._settle(add, error)
        self._deliver(outputs)

    def _drain(self) -> tuple[list[tuple[_Add, BaseException | None]], list[EngineOutput], set[str]]:
        """Apply the inbox in arrival order: adds go to the scheduler (or are refused), aborts free pages now.
        Returns the adds' verdicts, the terminal records of aborts to deliver, and every aborted id."""
        with self._cv:
            commands, self._inbox = list(self._inbox), deque()
        settles: list[tuple[_Add, BaseException | None]] = []
        outputs: list[EngineOutput] = []
        aborted: set[str] = set()
        for command in commands:
            if isinstance(command, _Add):
                try:
                    self.core.add_request(command.request)
                except (QueueFull, ValueError) as exc:
                    settles.append((command, exc))
                    continue
                self._live[command.request.req_id] = command.stream
                settles.append((command, None))
                continue
            req_id = command.message.req_id
            live = self._live.get(req_id)
            if live is None or (command.stream is not None and command.stream is not live):
                continue  # finished already, or a later submission of the same id
            output = self.core.abort(req_id)
            aborted.add(req_id)
            if command.stream is not None:  # its consumer left: nobody to tell
                del self._live[req_id]
            elif output is not None:
                outputs.append(output)
        return settles, outputs, aborted

    def _settle(self, add: _Add, error: BaseException | None) -> None:
        def settle() -> None:
            if not add.accepted.done():
                add.accepted.set_result(None) if error is None else add.accepted.set_exception(error)

        try:
            add.stream.loop.call_soon_threadsafe(settle)
        except RuntimeError:  # the submitter's loop is closed: nobody waits; drop the request if admitted
            if error is None and self._live.get(add.request.req_id) is add.stream:
                del self._live[add.request.req_id]
                self.core.abort(add.request.req_id)

    def _fail_inbox(self, error: BaseException) -> None:
        with self._cv:
            commands, self._inbox = list(self._inbox), deque()
        for command in commands:
            if isinstance(command, _Add):
                self._settle(command, error)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            stream = self._live.get(output.req_id)
            if stream is None:
                continue
            if output.finished:
                del self._live[output.req_id]
                self._forget(output.req_id, stream)
            if not self._send(stream, output) and not output.finished:
                # the caller's event loop is closed: nobody is listening
                del self._live[output.req_id]
                self._forget(output.req_id, stream)
                self.core.abort(output.req_id)

    @staticmethod
    def _send(stream: _Stream, output: EngineOutput) -> bool:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
            return True
        except RuntimeError:
            return False
