"""A connected reader that pauses mid-stream loses nothing: after the pause the rest of the stream
arrives and the text equals the same seeded request read without a pause (and its buffered form)."""

from __future__ import annotations

import json
import time

import httpx

BODY = {
    "model": "any",
    "prompt": "Once upon a time",
    "max_tokens": 48,
    "temperature": 0.8,
    "seed": 7,
    "ignore_eos": True,
    "stream": True,
}


def _events(lines):
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            yield json.loads(line[len("data: "):])


def _stream_text(server, pause_after: int | None) -> tuple[str, bool]:
    text, done = [], False
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        with c.stream("POST", "/v1/completions", json=BODY) as r:
            assert r.status_code == 200
            n = 0
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                    break
                for event in _events([line]):
                    text.append(event["choices"][0]["text"])
                    n += 1
                    if n == pause_after:
                        # the whole generation finishes while we do not read; it must be buffered
                        time.sleep(6)
    return "".join(text), done


def test_paused_reader_loses_nothing(server, http):
    paused, done = _stream_text(server, pause_after=2)
    assert done
    unpaused, _ = _stream_text(server, pause_after=None)
    buffered = http.post("/v1/completions", json={**BODY, "stream": False}).json()
    assert paused == unpaused == buffered["choices"][0]["text"]
    assert buffered["usage"]["completion_tokens"] == 48
