"""AsyncEngine: runs EngineCore's step loop on its own thread and streams outputs to asyncio callers.

Owns the engine thread, the per-request asyncio queues (fed through loop.call_soon_threadsafe) and the
idle wait (a condition variable: no busy-wait). Knows nothing about HTTP or tokenization.
Pure Python: must not import torch or numpy.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from helios.engine.engine_core import EngineCore, EngineMetrics
from helios.engine.messages import EngineOutput, EngineRequest

logger = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine is shut down or unhealthy (the server answers 503)."""


class AsyncEngine:
    def __init__(self, core: EngineCore, *, name: str = "helios-engine") -> None:
        self.core = core
        self._cv = threading.Condition()
        self._is_stopping = False
        self._fatal_error: str | None = None  # the loop itself crashed (a scheduler bug)
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[EngineOutput]]] = {}
        self._streams_lock = threading.Lock()
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
        return self.core.metrics()

    async def submit(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        """Enqueue now (raising QueueFull, ValueError or EngineUnavailable) and return the output stream.

        The stream ends after the terminal output; closing it early (aclose, or a dropped consumer being
        collected) aborts the request.
        """
        if not self.is_healthy:
            raise EngineUnavailable(self.error or "the engine is shut down")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        req_id = request.req_id
        with self._streams_lock:
            if req_id in self._streams:
                raise ValueError(f"request {req_id!r} is already active")
            self._streams[req_id] = (loop, queue)  # before add_request: the first output may come at once
        try:
            self.core.add_request(request)
        except BaseException:
            with self._streams_lock:
                self._streams.pop(req_id, None)
            raise
        with self._cv:  # NOTE: notify after add_request, so the loop's idle check under _cv sees the work
            self._cv.notify()
        return self._stream(req_id, queue)

    def abort(self, req_id: str) -> None:
        """Cancel a request from any thread; its pages are freed now and its stream ends with "abort"."""
        output = self.core.abort(req_id)
        if output is not None:
            self._deliver([output])

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the loop after the current step, join the thread, and end every open stream with "abort"."""
        with self._cv:
            self._is_stopping = True
            self._cv.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._streams_lock:
            req_ids = list(self._streams)
        for req_id in req_ids:
            output = self.core.abort(req_id) or EngineOutput(req_id=req_id, finished=True, finish_reason="abort")
            self._deliver([output])

    # --- internals ----------------------------------------------------------------------------

    async def _stream(self, req_id: str, queue: asyncio.Queue[EngineOutput]) -> AsyncIterator[EngineOutput]:
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
                self.abort(req_id)

    def _deliver(self, outputs: list[EngineOutput]) -> None:
        for output in outputs:
            with self._streams_lock:
                if output.finished:
                    entry = self._streams.pop(output.req_id, None)
                else:
                    entry = self._streams.get(output.req_id)
            if entry is None:
                continue
            loop, queue = entry
            try:
                loop.call_soon_threadsafe(queue.put_nowait, output)
            except RuntimeError:  # the caller's event loop is closed: nobody is listening
                if not output.finished:
                    self.core.abort(output.req_id)

    def _run(self) -> None:
        try:
            while True:
                with self._cv:
                    while not self._is_stopping and not self.core.has_unfinished_requests():
                        self._cv.wait()
                    if self._is_stopping:
                        return
                outputs = self.core.step()
                self._deliver(outputs)
        except Exception as exc:  # a bug in the engine itself: fail every stream, stay unhealthy
            logger.exception("engine loop crashed")
            self._fatal_error = f"engine loop crashed: {type(exc).__name__}: {exc}"
            with self._streams_lock:
                req_ids = list(self._streams)
            self._deliver(
                [EngineOutput(req_id=r, finished=True, finish_reason="error", error=self._fatal_error) for r in req_ids]
            )
