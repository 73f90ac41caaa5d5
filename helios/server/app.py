"""The ASGI app Granian serves: routing, auth, body limits and encodings, admission, lifespan.

The app owns the Runtime (engine included): lifespan startup runs the factory the composition root gave it
(helios/compose.py; or takes a prebuilt runtime) and its warm-up, then prints the ready line; shutdown stops the
engine. Protocol modules do the per-API work; every refusal is an ApiError answered in `_handle`, never a
traceback. No torch; imports of the engine are its public handle's messages only.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import msgspec

from helios.engine.messages import FrontendStats
from helios.server import encodings, errors
from helios.server.errors import ApiError
from helios.server.generation import Generation
from helios.server.http import JSON, ClientDisconnected, Request, run_until_disconnect
from helios.server.metrics import PROMETHEUS_CONTENT_TYPE, Snapshot, render_json, render_prometheus, wants_json
from helios.server.protocols import (anthropic_messages, decisions, ollama, openai_chat, openai_completions,
                                     openai_models, openai_responses, render, systemone)
from helios.server.runtime import Runtime
from helios.server.startup import ready_line

logger = logging.getLogger("helios.server")
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class HeliosApp:
    def __init__(self, runtime: Runtime | Callable[[], Runtime], warm: bool = True, announce: str | None = None,
                 warm_up: Callable[[Runtime], Awaitable[None]] | None = None, settings: str | None = None,
                 ready_line: bool = True):
        """runtime: a built Runtime, or the factory that builds one (run off the event loop at start-up);
        warm_up: one request through the engine before the ready line (when `warm`); announce: the URL it names;
        settings: what the ready line lists after it (the execution switches, helios.switches.describe());
        ready_line: False in a frontend process of a multi-process server (the engine process prints it)."""
        self._factory = runtime if callable(runtime) else None
        self.runtime: Runtime | None = None if callable(runtime) else runtime
        self._warm = warm
        self._warm_up = warm_up
        self._announce = announce
        self._settings = settings
        self._ready_line = ready_line
        self.startup_error: str | None = None  # why the lifespan start-up failed (the server then exits 1)

    # --- ASGI entry -----------------------------------------------------------------------------

    async def __call__(self, scope, receive, send):
        kind = scope["type"]
        if kind == "lifespan":
            await self._lifespan(receive, send)
        elif kind == "http":
            await self._handle(Request(scope, receive, send))
        elif kind == "websocket":
            await send({"type": "websocket.close", "code": 1003})

    async def _lifespan(self, receive, send):
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as e:  # one clear line, then Granian stops the worker
                    self.startup_error = str(e)
                    logger.error("helios: start-up failed: %s", e)
                    await send({"type": "lifespan.startup.failed", "message": str(e)})
                    return
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def startup(self) -> None:
        if self.runtime is None:
            self.runtime = await asyncio.get_running_loop().run_in_executor(None, self._factory)
        if self._warm and self._warm_up is not None:
            await self._warm_up(self.runtime)
        if self._ready_line:
            print(ready_line(self.runtime, self._announce, self._settings), flush=True)

    def shutdown(self) -> None:
        """Stop the engine (a second call is harmless)."""
        if self.runtime is not None:
            self.runtime.shutdown()

    # --- routing --------------------------------------------------------------------------------

    async def _handle(self, request: Request) -> None:
        extra: list[tuple[bytes, bytes]] = []
        try:
            if self.runtime is None:
                raise errors.unavailable("the model runtime is still starting")
            await self._route(request, extra)
        except ClientDisconnected:
            return
        except ApiError as e:
            if not request.response_started and not request.is_disconnected:
                await request.respond(e.status, errors.encode_for(request.path, e), JSON, extra)
        except RecursionError:  # NOTE: msgspec's answer to JSON nested past the recursion limit, on every route
            if not request.response_started and not request.is_disconnected:
                err = errors.bad_request("malformed JSON body: nested too deeply")
                err.shape = "ollama" if request.path.startswith("/api/") else None
                await request.respond(err.status, errors.encode_for(request.path, err), JSON, extra)
        except Exception as e:  # a bug: answer 500 with the spec's shape, never a traceback to the client
            logger.exception("unhandled error on %s %s", request.method, request.path)
            if not request.response_started and not request.is_disconnected:
                try:
                    err = errors.server_error(f"internal error: {type(e).__name__}")
                    await request.respond(err.status, errors.encode_for(request.path, err), JSON, extra)
                except ClientDisconnected:
                    pass

    async def _route(self, request: Request, extra: list) -> None:
        path = request.path
        route = ROUTES.get(MODEL_PREFIX if path.startswith(MODEL_PREFIX) else path)
        if route is None:
            raise errors.not_found(path)
        if route.auth is not None:
            self._authenticate(request, anthropic=route.auth == "anthropic")
        if request.method != route.method:
            raise errors.method_not_allowed(request.method, path)
        if route.auth == "anthropic":
            anthropic_messages.check_version(request.headers)
        await route.handle(self, request, extra)

    def _authenticate(self, request: Request, anthropic: bool = False) -> None:
        """Bearer KEY; Anthropic routes also take x-api-key: KEY, and when both come both must match."""
        key = self.runtime.config.api_key
        if not key:
            return
        header = request.headers.get("authorization")
        api_key = request.headers.get("x-api-key") if anthropic else None
        if header is None and api_key is None:
            raise errors.unauthorized()
        if header is not None:
            scheme, _, token = header.partition(" ")
            # NOTE: constant-time compare; the scheme check is not secret
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
                raise errors.unauthorized()
        if api_key is not None and not hmac.compare_digest(api_key.strip().encode(), key.encode()):
            raise errors.unauthorized()

    # --- simple routes --------------------------------------------------------------------------

    async def _health(self, request: Request) -> None:
        engine = self.runtime.engine
        if engine.is_healthy:
            await request.respond_json(200, {"status": "ok"})
        else:
            error = getattr(engine, "error", None) or "the model runtime is unhealthy"
            await request.respond_error(errors.unavailable(error))

    def frontend_stats(self) -> FrontendStats:
        """This process's HTTP counters, as the engine process sums them over the frontends."""
        rt = self.runtime
        return FrontendStats(http_requests=rt.http_metrics.num_requests, admission_slots=rt.admission.slots,
                             admission_in_use=rt.admission.in_use, first_response=rt.http_metrics.recent())

    def snapshot(self, frontends: FrontendStats | None = None) -> Snapshot:
        """/metrics: the HTTP counters (this process's, or every frontend's summed) plus the engine's public
        metrics (the runner's counters folded in by the engine), never the engine's internals."""
        rt = self.runtime
        http = frontends or self.frontend_stats()
        snap = Snapshot(
            decode_weight_bytes=rt.manifest.decode_weight_bytes,
            first_response=rt.http_metrics.first_response(http.first_response),
            http_admission_slots=http.admission_slots,
            http_admission_in_use=http.admission_in_use,
            http_requests=http.http_requests,
            uptime_seconds=int(time.monotonic() - rt.started),
        )
        metrics = rt.engine.metrics()
        values = {f: getattr(metrics, f) for f in metrics.__struct_fields__ if f in Snapshot.__struct_fields__}
        return msgspec.structs.replace(snap, **values)

    async def current_snapshot(self) -> Snapshot:
        """snapshot() after asking an engine in another process for its metrics and the frontends' sums."""
        refresh = getattr(self.runtime.engine, "refresh_metrics", None)
        if refresh is None:
            return self.snapshot()
        try:
            frontends = await refresh(self.frontend_stats())
        except RuntimeError as e:  # EngineUnavailable: the engine process is gone
            raise errors.unavailable(f"the model runtime is unavailable: {e}") from None
        return self.snapshot(frontends)

    async def _metrics(self, request: Request) -> None:
        try:
            as_json = wants_json(request.query, request.headers.get("accept"))
        except ValueError as e:
            raise errors.bad_request(f"unsupported metrics format {e}; use json or prometheus", "format") from None
        snap = await self.current_snapshot()
        if as_json:
            await request.respond(200, render_json(snap))
        else:
            await request.respond(200, render_prometheus(snap), PROMETHEUS_CONTENT_TYPE)

    async def _models(self, request: Request, name: str | None) -> None:
        rt = self.runtime
        body = openai_models.list_models(rt) if name is None else openai_models.get_model(rt, name)
        await request.respond_json(200, body)

    # --- generation -----------------------------------------------------------------------------

    async def _read_json_body(self, request: Request) -> bytes:
        limit = self.runtime.config.max_body_bytes
        codings = encodings.parse_encodings(request.headers.get("content-encoding"))
        raw = await request.read_body(limit)
        if not codings:
            return raw
        return await self.runtime.run_blocking(encodings.decode_body, raw, codings, limit)

    def _count_request(self, request: Request, extra: list) -> None:
        """A generating request: counted, and answered with its x-request-id (the caller's when well-formed)."""
        self.runtime.http_metrics.num_requests += 1
        incoming = request.headers.get("x-request-id", "")
        request_id = incoming if _REQUEST_ID.match(incoming) else uuid.uuid4().hex
        extra.append((b"x-request-id", request_id.encode()))

    async def _generate(self, request: Request, protocol, extra: list) -> None:
        """Every generating route: decode -> prepare on the frontend pool -> admission (a slot per choice) ->
        submit -> the protocol's buffered or SSE encoding. `protocol` has prepare, buffered and stream_events."""
        rt = self.runtime
        self._count_request(request, extra)
        body = await self._read_json_body(request)
        prep = await rt.run_blocking(protocol.prepare, body, rt.model)
        num_slots = max(1, len(prep.children))
        rt.admission.acquire(num_slots)
        try:
            gen = Generation(rt, prep.children)
            await gen.submit()
            if prep.stream:
                events = protocol.stream_events(rt, prep, gen)
                await run_until_disconnect(request, request.stream_sse(events, extra))
                return
            result = await run_until_disconnect(request, protocol.buffered(rt, prep, gen))
            await request.respond_json(200, result, extra)
        finally:
            rt.admission.release(num_slots)

    async def _count_tokens(self, request: Request) -> None:
        body = await self._read_json_body(request)
        rt = self.runtime
        await request.respond_json(200, await rt.run_blocking(anthropic_messages.count_tokens, body, rt.model))

    async def _render(self, request: Request, renderer) -> None:
        """vLLM's render routes: the generating route's preparation on the frontend pool, its prompt ids and
        resolved sampling answered; no admission slot, nothing submitted (protocols/render.py)."""
        body = await self._read_json_body(request)
        rt = self.runtime
        await request.respond_json(200, await rt.run_blocking(renderer, body, rt.model))

    async def _ollama_show(self, request: Request) -> None:
        try:
            body = await request.read_body(self.runtime.config.max_body_bytes)
        except ApiError as e:  # 413: a discovery error, in the discovery shape
            e.shape = "ollama"
            raise
        await request.respond_json(200, ollama.show(self.runtime, body, request.headers.get("content-encoding")))

    async def _decide(self, request: Request, protocol, extra: list) -> None:
        """System One and Decisions: questions scored one after another, under one admission slot."""
        rt = self.runtime
        self._count_request(request, extra)
        protocol.check_transport(request.headers)
        body = await self._read_json_body(request)
        prep = await rt.run_blocking(protocol.prepare, body, rt.model)
        rt.admission.acquire(1)
        try:
            result = await run_until_disconnect(request, protocol.execute(rt, prep))
            await request.respond_json(200, result, extra)
        finally:
            rt.admission.release(1)


@dataclass(frozen=True)
class Route:
    """One path: its method, how it authenticates (None: open; "anthropic": x-api-key too, plus the
    anthropic-version check) and its handler (app, request, extra headers)."""

    method: str
    auth: Literal["bearer", "anthropic"] | None
    handle: Callable[[HeliosApp, Request, list], Awaitable[None]]


MODEL_PREFIX = "/v1/models/"
ROUTES: dict[str, Route] = {
    "/health": Route("GET", None, lambda app, r, x: app._health(r)),
    "/metrics": Route("GET", None, lambda app, r, x: app._metrics(r)),
    "/v1/models": Route("GET", "bearer", lambda app, r, x: app._models(r, None)),
    MODEL_PREFIX: Route("GET", "bearer", lambda app, r, x: app._models(r, r.path[len(MODEL_PREFIX):])),
    "/v1/chat/completions": Route("POST", "bearer", lambda app, r, x: app._generate(r, openai_chat, x)),
    "/v1/completions": Route("POST", "bearer", lambda app, r, x: app._generate(r, openai_completions, x)),
    "/v1/chat/completions/render": Route("POST", "bearer", lambda app, r, x: app._render(r, render.chat)),
    "/v1/completions/render": Route("POST", "bearer", lambda app, r, x: app._render(r, render.completions)),
    "/v1/messages": Route("POST", "anthropic", lambda app, r, x: app._generate(r, anthropic_messages, x)),
    "/v1/messages/count_tokens": Route("POST", "anthropic", lambda app, r, x: app._count_tokens(r)),
    "/v1/responses": Route("POST", "bearer", lambda app, r, x: app._generate(r, openai_responses, x)),
    "/v1/systemone": Route("POST", "bearer", lambda app, r, x: app._decide(r, systemone, x)),
    "/v1/decisions": Route("POST", "bearer", lambda app, r, x: app._decide(r, decisions, x)),
    "/api/tags": Route("GET", "bearer", lambda app, r, x: r.respond_json(200, ollama.tags(app.runtime))),
    "/api/show": Route("POST", "bearer", lambda app, r, x: app._ollama_show(r)),
}
