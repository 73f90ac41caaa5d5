"""Soak: 200 mixed requests with seeded random mid-stream disconnects leave the engine clean.

Chat and Completions, streaming and buffered, eight at a time from threads. About a third of the streams
drop their connection after k data chunks (a long ignore_eos generation, so the drop lands mid-stream).
Afterwards /metrics?format=json must show every KV page free again, no active or pending request, no
admission slot held and a server that still answers. Short max_tokens keep it around half a minute on 2 quiet cores.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

NUM_REQUESTS = 200
CONCURRENCY = 8
SEED = 20261202
PROMPTS = ["Say OK.", "Name a colour.", "Count to three.", "What is 2+2?", "Write one word.", "Hello!"]


@dataclass(frozen=True)
class Plan:
    chat: bool
    stream: bool
    max_tokens: int
    drop_after: int | None  # close the connection after this many SSE data chunks (streams only)
    prompt: str

    def body(self) -> dict:
        body: dict = {"max_tokens": self.max_tokens, "stream": self.stream, "temperature": 0}
        if self.drop_after is not None:
            body["ignore_eos"] = True  # keep generating until the client leaves
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        return body


def _plans(rng: random.Random) -> list[Plan]:
    plans = []
    for _ in range(NUM_REQUESTS):
        chat, stream = rng.random() < 0.5, rng.random() < 0.6
        drop = stream and rng.random() < 0.5
        plans.append(Plan(
            chat=chat, stream=stream,
            max_tokens=rng.randint(24, 48) if drop else rng.randint(1, 4),
            drop_after=rng.randint(0, 3) if drop else None,
            prompt=rng.choice(PROMPTS),
        ))
    return plans


def _run(client: httpx.Client, plan: Plan) -> str:
    path = "/v1/chat/completions" if plan.chat else "/v1/completions"
    if not plan.stream:
        r = client.post(path, json=plan.body())
        assert r.status_code == 200, r.text
        assert r.json()["choices"], r.text
        return "buffered"
    with client.stream("POST", path, json=plan.body()) as r:
        assert r.status_code == 200, r.read()
        chunks = 0
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return "stream"
            event = json.loads(data)
            assert "error" not in event, event
            chunks += 1
            if plan.drop_after is not None and chunks > plan.drop_after:
                return "dropped"  # leaving the block closes the unread response: the connection goes away
    raise AssertionError(f"the stream ended without [DONE]: {plan}")


def _snapshot(url: str) -> dict:
    return httpx.get(url + "/metrics", params={"format": "json"}, timeout=10).json()


def test_soak_with_disconnects_drains(server):
    plans = _plans(random.Random(SEED))
    before = _snapshot(server.url)
    t0 = time.monotonic()
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        clients = [httpx.Client(base_url=server.url, headers=server.headers(), timeout=60) for _ in range(CONCURRENCY)]
        try:
            outcomes = list(pool.map(lambda ip: _run(clients[ip[0] % CONCURRENCY], ip[1]), enumerate(plans)))
        finally:
            for c in clients:
                c.close()
    elapsed = time.monotonic() - t0
    assert len(outcomes) == NUM_REQUESTS
    assert outcomes.count("dropped") >= 20, outcomes  # the seed really exercises disconnects

    deadline = time.monotonic() + 15  # aborted requests drain through the engine thread
    while True:
        snap = _snapshot(server.url)
        idle = (snap["active"], snap["pending"], snap["http_admission_in_use"]) == (0, 0, 0)
        if (idle and snap["free_pages"] == snap["total_pages"]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert snap["active"] == 0 and snap["pending"] == 0, snap
    assert snap["http_admission_in_use"] == 0, snap
    assert snap["free_pages"] == snap["total_pages"], snap
    assert snap["failed"] == before["failed"], snap  # disconnects are aborts, not failures
    assert snap["http_requests"] - before["http_requests"] >= NUM_REQUESTS
    # the drops were aborted, not run to their budgets (which alone would be ~2000 tokens)
    kept = sum(p.max_tokens for p in plans if p.drop_after is None)
    dropped = sum(p.max_tokens for p in plans if p.drop_after is not None)
    generated = snap["generated_tokens"] - before["generated_tokens"]
    assert generated < kept + dropped // 2, (generated, kept, dropped)

    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers(), timeout=60,
                   json={"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]
    print(f"\nsoak: {NUM_REQUESTS} requests ({outcomes.count('dropped')} dropped mid-stream) in {elapsed:.1f}s, "
          f"{generated} tokens generated (budgets: {kept} kept, {dropped} dropped)")
