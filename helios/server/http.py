"""The thin ASGI layer: request view, bounded body reading, JSON and SSE responses, disconnect watch.

No framework: Granian calls the app with ASGI scopes; this module is the only one that speaks ASGI messages.
No torch.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from urllib.parse import parse_qs

import msgspec

from helios.server.errors import ApiError, too_large

Send = Callable[[dict], Awaitable[None]]
Receive = Callable[[], Awaitable[dict]]
JSON = b"application/json"
KEEPALIVE_S = 15.0
SSE_HEADERS = [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache"),
               (b"x-accel-buffering", b"no")]


class ClientDisconnected(Exception):
    """The client went away; the request's engine work must be aborted."""


class Request:
    def __init__(self, scope: dict, receive: Receive, send: Send):
        self.scope = scope
        self.receive = receive
        self._send = send
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers: dict[str, str] = {}
        for k, v in scope.get("headers", []):
            key = k.decode("latin-1").lower()
            value = v.decode("latin-1")
            self.headers[key] = f"{self.headers[key]}, {value}" if key in self.headers else value
        qs = scope.get("query_string", b"").decode("latin-1")
        self.query = {k: v[-1] for k, v in parse_qs(qs, keep_blank_values=True).items()}
        self.is_disconnected = False
        self.response_started = False

    async def read_body(self, limit: int) -> bytes:
        """The raw (still encoded) body; 413 as soon as it passes `limit`, without reading the rest."""
        length = self.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large(limit, decoded=False)
        chunks, size = [], 0
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.is_disconnected = True
                raise ClientDisconnected()
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise too_large(limit, decoded=False)
            chunks.append(body)
            if not message.get("more_body", False):
                return b"".join(chunks)

    async def wait_disconnect(self) -> None:
        """Returns when the client disconnects (run as a task after the body is read)."""
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                self.is_disconnected = True
                return

    async def send(self, message: dict) -> None:
        try:
            await self._send(message)
        except Exception as e:  # NOTE: Granian raises on a closed transport; that is a disconnect
            self.is_disconnected = True
            raise ClientDisconnected() from e

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.response_started = True
        await self.send({"type": "http.response.start", "status": status, "headers": headers})

    async def respond(self, status: int, body: bytes, content_type: bytes = JSON,
                      headers: list[tuple[bytes, bytes]] | None = None) -> None:
        all_headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
        await self.start(status, all_headers + (headers or []))
        await self.send({"type": "http.response.body", "body": body, "more_body": False})

    async def respond_json(self, status: int, obj, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.respond(status, msgspec.json.encode(obj), JSON, headers)

    async def respond_error(self, err: ApiError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        await self.respond(err.status, err.encode(), JSON, headers)

    async def stream_sse(self, events: AsyncIterator[bytes], headers: list[tuple[bytes, bytes]]) -> None:
        """Send 200 + SSE headers, then each already-framed event; a comment keeps long waits alive.

        NOTE: a producer task fills an unbounded queue (a response buffers up to its output limit, as the
        spec allows) and one getter task is reused across keepalive timeouts, so no event is ever lost."""
        await self.start(200, SSE_HEADERS + headers)
        queue: asyncio.Queue = asyncio.Queue()
        done = object()

        async def produce() -> None:
            try:
                async for chunk in events:
                    queue.put_nowait(chunk)
                queue.put_nowait(done)
            except Exception as e:
                queue.put_nowait(e)

        producer = asyncio.ensure_future(produce())
        getter = None
        try:
            while True:
                getter = getter or asyncio.ensure_future(queue.get())
                finished, _ = await asyncio.wait({getter}, timeout=KEEPALIVE_S)
                if not finished:
                    await self.send({"type": "http.response.body", "body": b": keepalive\n\n", "more_body": True})
                    continue
                item, getter = getter.result(), None
                if item is done:
                    break
                if isinstance(item, Exception):
                    raise item
                await self.send({"type": "http.response.body", "body": item, "more_body": True})
            await self.send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            if getter is not None:
                getter.cancel()
            producer.cancel()


def sse_event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def sse_named(event: str, data: bytes) -> bytes:
    """A named SSE event (Messages and Responses streams)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"


async def run_until_disconnect(request: Request, work: Awaitable) -> object:
    """Run `work`; cancel it (aborting its engine requests in their finally blocks) when the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(request.wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
