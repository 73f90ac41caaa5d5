"""The app in-process (httpx ASGI transport) around a scripted fake engine: failure paths and edge cases."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from helios.core.manifest import TemplateCaps
from helios.engine.messages import EngineOutput, PositionLogprobs, TokenLogprob
from helios.engine.async_engine import QueueFull
from helios.server.app import HeliosApp
from helios.server.config import ServerConfig
from helios.server.runtime import Runtime
from tests.frontend.conftest import byte_level_tok, make_manifest, tokenizer  # noqa: F401 (fixtures)

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


class FakeEngine:
    """`script(request) -> list[EngineOutput | Exception]`; records aborts."""

    def __init__(self, script):
        self.script = script
        self.aborted: list[str] = []
        self.is_healthy = True
        self.error = None
        self.submit_error: Exception | None = None

    async def submit(self, request):
        if self.submit_error is not None:
            raise self.submit_error
        outputs = self.script(request)

        async def stream():
            done = False
            try:
                for out in outputs:
                    await asyncio.sleep(0)
                    if isinstance(out, Exception):
                        raise out
                    done = out.finished
                    yield out
            finally:
                if not done:
                    self.abort(request.req_id)

        return stream()

    def abort(self, req_id):
        self.aborted.append(req_id)

    def metrics(self):
        from helios.engine.engine_core import EngineMetrics

        return EngineMetrics(prefill_tokens=0, generated_tokens=0, completed=0, failed=0, active=0, pending=0,
                             free_pages=1, total_pages=1, page_tokens=16)


def _out(req, ids, finished=False, reason=None, stop_token=None, error=None):
    lps = [PositionLogprobs(TokenLogprob(t, -1.0, 1), [TokenLogprob(t, -1.0, 1)]) for t in ids]
    return EngineOutput(req_id=req.req_id, new_token_ids=ids, logprobs=lps, finished=finished, finish_reason=reason,
                        stop_token=stop_token, num_prompt_tokens=len(req.prompt_token_ids), error=error)


@pytest.fixture
def make_client(tokenizer):
    eos = tokenizer.info.eos_token_ids[0]
    manifest = make_manifest(tokenizer=tokenizer.info, template=TemplateCaps(present=True, file="t.jinja"))

    def build(script, **config):
        engine = FakeEngine(lambda req: script(req, eos))
        runtime = Runtime(manifest, tokenizer, TEMPLATE, engine, ServerConfig(**config))
        app = HeliosApp(runtime, warm=False)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t"), engine

    return build


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def _events(text: str) -> list:
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_eos_hidden_and_usage(make_client, tokenizer):
    hello = _ids(tokenizer, "hello world")

    def script(req, eos):
        return [_out(req, hello[:1]), _out(req, hello[1:] + [eos], True, "stop", eos)]

    async def main():
        c, _ = make_client(script)
        async with c:
            r = await c.post("/v1/chat/completions", json={**CHAT, "logprobs": True})
        body = r.json()
        assert body["choices"][0]["message"]["content"] == "hello world"
        assert len(body["choices"][0]["logprobs"]["content"]) == len(hello)
        assert body["usage"]["completion_tokens"] == len(hello) + 1
        assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}

    asyncio.run(main())


def test_execution_error_is_500_buffered_and_terminal_event_streamed(make_client, tokenizer):
    tok = _ids(tokenizer, "hello")

    def script(req, eos):
        return [_out(req, tok), _out(req, [], True, "error", error="runner exploded")]

    async def main():
        c, _ = make_client(script)
        async with c:
            r = await c.post("/v1/chat/completions", json=CHAT)
            assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
            s = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = _events(s.text)
        assert s.status_code == 200
        assert json.loads(events[0])["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert "error" in json.loads(events[-1]) and "[DONE]" not in events

    asyncio.run(main())


def test_failure_before_first_token_has_no_role_chunk(make_client):
    async def main():
        c, _ = make_client(lambda req, eos: [_out(req, [], True, "error", error="admission failed")])
        async with c:
            s = await c.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = _events(s.text)
        assert len(events) == 1 and json.loads(events[0])["error"]["code"] == "internal_error"

    asyncio.run(main())


def test_stop_string_aborts_the_engine_request(make_client, tokenizer):
    ids = _ids(tokenizer, "hello world and more")

    def script(req, eos):
        return [_out(req, [t]) for t in ids] + [_out(req, [], True, "length")]

    async def main():
        c, engine = make_client(script)
        async with c:
            r = await c.post("/v1/completions", json={"prompt": "x", "stop": [" wor"], "max_tokens": 8})
        choice = r.json()["choices"][0]
        assert choice["text"] == "hello" and choice["finish_reason"] == "stop" and choice["stop_reason"] == " wor"
        assert engine.aborted  # the engine request was cut short

    asyncio.run(main())


def test_token_stops_report_their_id_on_every_openai_route(make_client, tokenizer):
    """A stop_token_ids stop reports the id as stop_reason on Chat and Completions, buffered and on the finishing
    stream chunk; EOS and token sequences report null (issue 19: Completions said null and streamed none)."""
    hello = _ids(tokenizer, "hello")
    stop = _ids(tokenizer, " world")[0]

    def script(req, eos):
        sampling = req.sampling
        if sampling.stop_token_sequences:
            seq = list(sampling.stop_token_sequences[0])
            return [_out(req, hello), _out(req, seq, True, "stop", stop_token=seq)]
        if sampling.stop_token_ids:
            return [_out(req, hello), _out(req, [stop], True, "stop", stop_token=stop)]
        return [_out(req, hello), _out(req, [eos], True, "stop", stop_token=eos)]

    async def main():
        c, _ = make_client(script)
        async with c:
            for route, body in (("/v1/completions", {"prompt": "x", "max_tokens": 8}), ("/v1/chat/completions", CHAT)):
                for extra, want in (({"stop_token_ids": [stop]}, stop), ({}, None),
                                    ({"stop_token_sequences": [[stop, stop]]}, None)):
                    r = await c.post(route, json={**body, **extra})
                    choice = r.json()["choices"][0]
                    assert (choice["finish_reason"], choice["stop_reason"]) == ("stop", want), (route, extra)
                    if route == "/v1/completions":
                        s = await c.post(route, json={**body, **extra, "stream": True})
                        chunks = [json.loads(e) for e in _events(s.text)[:-1]]
                        last = chunks[-1]["choices"][0]
                        assert last["finish_reason"] == "stop" and last["stop_reason"] == want, extra
                        assert all("stop_reason" not in ch["choices"][0] for ch in chunks[:-1])

    asyncio.run(main())


def test_responses_names_max_output_tokens(make_client):
    async def main():
        c, _ = make_client(lambda req, eos: [])
        async with c:
            r = await c.post("/v1/responses", json={"input": "hi", "max_output_tokens": 0})
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == "max_output_tokens"
        assert err["message"] == "max_output_tokens must be a positive integer"

    asyncio.run(main())


def test_queue_full_and_unavailable_are_503(make_client):
    async def main():
        c, engine = make_client(lambda req, eos: [])
        async with c:
            engine.submit_error = QueueFull("full")
            r = await c.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 503 and r.headers["x-request-id"]
            engine.is_healthy = False
            engine.error = "engine loop crashed"
            h = await c.get("/health")
            assert h.status_code == 503 and "crashed" in h.json()["error"]["message"]

    asyncio.run(main())


def test_auth_and_405(make_client):
    async def main():
        c, _ = make_client(lambda req, eos: [], api_key="sekrit")
        async with c:
            assert (await c.get("/v1/models")).status_code == 401
            ok = await c.get("/v1/models", headers={"authorization": "Bearer sekrit"})
            assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
            assert (await c.get("/v1/models/org/tiny-model", headers={"authorization": "Bearer sekrit"})).status_code == 200
            r = await c.get("/v1/chat/completions", headers={"authorization": "Bearer sekrit"})
            assert r.status_code == 405

    asyncio.run(main())


def test_sse_keepalive_during_long_waits(make_client, tokenizer, monkeypatch):
    import helios.server.http as http_mod

    monkeypatch.setattr(http_mod, "KEEPALIVE_S", 0.05)
    ids = _ids(tokenizer, "hello")

    def script(req, eos):
        return [_out(req, ids, True, "length")]

    async def main():
        c, engine = make_client(script)
        real_submit = engine.submit

        async def slow_submit(request):
            stream = await real_submit(request)

            async def delayed():
                await asyncio.sleep(0.3)
                async for out in stream:
                    yield out

            return delayed()

        engine.submit = slow_submit
        async with c:
            s = await c.post("/v1/completions", json={"prompt": "x", "stream": True})
        assert ": keepalive" in s.text and s.text.rstrip().endswith("data: [DONE]")
        assert "hello" in s.text

    asyncio.run(main())
