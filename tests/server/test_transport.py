"""Transport and admission over raw HTTP: every status code of the spec, encodings, auth, health, metrics."""

from __future__ import annotations

import gzip
import json
import threading
import time
import zlib

import brotli
import httpx
import pytest
import zstandard

CHAT = {"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 2}
LONG = {"prompt": "Count: 1, 2, 3,", "max_tokens": 2000, "ignore_eos": True, "stream": True}


def _error(resp: httpx.Response, status: int, type_: str) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["type"] == type_ and set(err) == {"type", "message", "param", "code"}
    return err


def _post(http, path, body: bytes, **headers):
    return http.post(path, content=body, headers={"content-type": "application/json", **headers})


@pytest.mark.parametrize("coding,encode", [
    ("gzip", gzip.compress), ("deflate", zlib.compress), ("br", brotli.compress),
    ("zstd", lambda b: zstandard.ZstdCompressor().compress(b)), ("identity", lambda b: b),
])
def test_compressed_bodies(http, coding, encode):
    r = _post(http, "/v1/chat/completions", encode(json.dumps(CHAT).encode()), **{"content-encoding": coding})
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"]


def test_stacked_encodings(http):
    body = brotli.compress(gzip.compress(json.dumps(CHAT).encode()))
    assert _post(http, "/v1/chat/completions", body, **{"content-encoding": "gzip, br"}).status_code == 200


def test_400_malformed_and_mistyped(http):
    _error(_post(http, "/v1/chat/completions", b"{not json"), 400, "invalid_request_error")
    err = _error(http.post("/v1/chat/completions", json={**CHAT, "top_k": 1.5}), 400, "invalid_request_error")
    assert err["param"] == "top_k"
    _error(http.post("/v1/chat/completions", json={"messages": "hi"}), 400, "invalid_request_error")
    _error(http.post("/v1/completions", json={"prompt": []}), 400, "invalid_request_error")
    _error(http.post("/v1/completions", json={"prompt": "x", "stop": ["a"] * 5}), 400, "invalid_request_error")
    _error(http.post("/v1/completions", json={"prompt": "x", "best_of": 3}), 400, "invalid_request_error")
    _error(_post(http, "/v1/chat/completions", gzip.compress(b"x")[:-5], **{"content-encoding": "gzip"}),
           400, "invalid_request_error")


def test_400_over_context(http):
    err = _error(http.post("/v1/completions", json={"prompt": [1] * 8000, "max_tokens": 500}), 400,
                 "invalid_request_error")
    assert "context length" in err["message"]


def test_401_missing_or_wrong_key(server):
    body = json.dumps(CHAT).encode()
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.api_key}):
        r = httpx.post(server.url + "/v1/chat/completions", content=body, headers=headers)
        _error(r, 401, "authentication_error")
    _error(httpx.get(server.url + "/v1/models"), 401, "authentication_error")
    assert httpx.get(server.url + "/health").status_code == 200  # open routes
    assert httpx.get(server.url + "/metrics").status_code == 200


def test_404_unknown_model_and_route(http):
    err = _error(http.get("/v1/models/org/unknown-model"), 404, "invalid_request_error")
    assert err["code"] == "model_not_found"
    assert http.get("/v1/nothing").status_code == 404


def test_413_encoded_and_decoded(http, server):
    big = b" " * (33 << 20)
    _error(_post(http, "/v1/chat/completions", big), 413, "request_too_large")
    bomb = gzip.compress(b"{" + b" " * (40 << 20) + b"}")
    assert len(bomb) < 1 << 20
    _error(_post(http, "/v1/chat/completions", bomb, **{"content-encoding": "gzip"}), 413, "request_too_large")
    zbomb = zstandard.ZstdCompressor().compress(b" " * (40 << 20))
    _error(_post(http, "/v1/completions", zbomb, **{"content-encoding": "zstd"}), 413, "request_too_large")
    assert httpx.get(server.url + "/health").status_code == 200


def test_415_unknown_encoding(http):
    err = _error(_post(http, "/v1/chat/completions", b"{}", **{"content-encoding": "compress"}), 415,
                 "invalid_request_error")
    assert "compress" in err["message"]


def test_x_request_id_is_echoed(http):
    r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, headers={"x-request-id": "abc-123"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "abc-123"


def _hold_stream(url: str, body: dict, started: threading.Event, stop: threading.Event, n_chunks: int = 1):
    with httpx.Client(timeout=120) as c, c.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i >= n_chunks:
                started.set()
            if stop.is_set():
                return


def test_503_queue_full_and_429_admission(tight_server):
    """One model slot, a one-request queue, three admission slots."""
    url = tight_server.url
    stop = threading.Event()
    running, waiting = threading.Event(), threading.Event()
    threads = [threading.Thread(target=_hold_stream, args=(url + "/v1/completions", LONG, running, stop))]
    threads[0].start()
    assert running.wait(60)
    # the second request waits in the queue (its stream opens at enqueue, without output)
    second = threading.Thread(target=_hold_stream, args=(url + "/v1/completions", LONG, waiting, stop, -1))
    second.start()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and httpx.get(url + "/metrics?format=json").json()["pending"] < 1:
        time.sleep(0.1)
    assert httpx.get(url + "/metrics?format=json").json()["pending"] == 1
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=60)
        _error(r, 503, "server_error")
        assert r.headers.get("x-request-id")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 2}, timeout=60)
        _error(r, 429, "rate_limit_error")
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 4}, timeout=60)
        _error(r, 400, "invalid_request_error")  # an oversized group never fits
    finally:
        stop.set()
        for t in (threads[0], second):
            t.join(60)
    # the dropped streams were aborted (2000 tokens would take a minute): the engine drains to idle
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = httpx.get(url + "/metrics?format=json").json()
        if snap["active"] == 0 and snap["pending"] == 0 and snap["http_admission_in_use"] == 0:
            break
        time.sleep(0.2)
    assert (snap["active"], snap["pending"], snap["http_admission_in_use"]) == (0, 0, 0)
    assert snap["free_pages"] == snap["total_pages"]


def test_dropped_buffered_request_is_aborted(tight_server):
    url = tight_server.url
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={**LONG, "stream": False}, timeout=2.0)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snap = httpx.get(url + "/metrics?format=json").json()
        if snap["active"] == 0 and snap["http_admission_in_use"] == 0:
            break
        time.sleep(0.2)
    assert snap["active"] == 0 and snap["http_admission_in_use"] == 0


def _wait_idle(url: str) -> dict:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snap = httpx.get(url + "/metrics?format=json").json()
        if snap["active"] == 0 and snap["pending"] == 0 and snap["http_admission_in_use"] == 0:
            return snap
        time.sleep(0.2)
    raise AssertionError(f"the server never went idle: {snap}")


def test_an_n2_request_on_an_idle_server_is_served_despite_max_waiting_1(tight_server):
    """Issue 19: the waiting bound counts only requests beyond the free model slots. With one slot and one
    waiting place, an idle server runs an n=2 group (one choice runs, one waits); n=3 would need two places."""
    url = tight_server.url
    _wait_idle(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 2}, timeout=60)
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1]
    _wait_idle(url)
    r = httpx.post(url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "n": 3}, timeout=60)
    _error(r, 503, "server_error")
    snap = _wait_idle(url)  # the group's admitted choices were aborted with it
    assert snap["free_pages"] == snap["total_pages"]


def test_health_and_metrics_formats(server, http):
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    text = httpx.get(server.url + "/metrics")
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain; version=0.0.4")
    body = text.text
    for name in ("flare_generated_tokens_total", "flare_active_requests", "flare_free_kv_pages",
                 "flare_http_admission_slots", "flare_uptime_seconds", "flare_graph_captures_pending"):
        assert f"\n{name} " in body and f"# TYPE {name} " in body
    snap = httpx.get(server.url + "/metrics?format=json").json()
    assert snap["generated_tokens"] > 0 and snap["total_pages"] > 0 and snap["learned_drafter"] is False
    assert snap["graph_captures_pending"] == 0  # the CPU captures none
    assert set(snap["first_response"]) == {"median_seconds", "samples", "window_seconds", "capacity", "truncated"}
    accept = {"accept": "text/plain;q=0.5, application/json"}
    assert httpx.get(server.url + "/metrics", headers=accept).headers["content-type"] == "application/json"
    assert httpx.get(server.url + "/metrics", headers={"accept": "application/json;q=0.4, text/plain"}).text.startswith("#")
    assert httpx.get(server.url + "/metrics?format=prometheus", headers=accept).text.startswith("#")
    _error(httpx.get(server.url + "/metrics?format=xml"), 400, "invalid_request_error")


def test_one_http_process_takes_more_streams_than_granians_default(tmp_path):
    """Granian's embedded server holds a process to 128 requests at once unless told otherwise (backpressure =
    backlog 128 / 1 worker) and leaves the rest unread: helios admits by its own slots, so 160 streams held open
    on one HTTP process all reach the engine (running or queued), and /metrics still answers beside them."""
    import asyncio

    from tests.server.conftest import _start, _stop

    num_streams = 160
    srv = _start(tmp_path, "wide", "http_workers = 1\nmax_concurrency = 2\nmax_waiting = 400\n", "")
    try:
        async def main() -> tuple[int, int]:
            limits = httpx.Limits(max_connections=num_streams + 8, max_keepalive_connections=num_streams + 8)
            async with httpx.AsyncClient(base_url=srv.url, limits=limits, timeout=60) as c:
                async def hold(opened: asyncio.Event, done: asyncio.Event) -> None:
                    async with c.stream("POST", "/v1/completions", json=LONG) as r:
                        assert r.status_code == 200  # SSE headers at enqueue, before any model slot
                        opened.set()
                        await done.wait()

                done = asyncio.Event()
                opened = [asyncio.Event() for _ in range(num_streams)]
                tasks = [asyncio.create_task(hold(e, done)) for e in opened]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in opened)), 60)
                snap = (await c.get("/metrics?format=json", timeout=10)).json()
                done.set()
                await asyncio.gather(*tasks)
                return snap["active"], snap["pending"]

        active, pending = asyncio.run(main())
        assert 1 <= active <= 2 and active + pending == num_streams
        snap = _wait_idle(srv.url)  # the closed streams were aborted
        assert snap["free_pages"] == snap["total_pages"]
    finally:
        _stop(srv.proc)
