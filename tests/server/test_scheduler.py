"""Scheduler regressions over HTTP against one otherwise idle service with four request slots.

    FLARE_RUN_CUDA_TESTS=1 FLARE_SCHEDULER_TEST_URL=http://127.0.0.1:8000 \\
      .venv/bin/python -m pytest tests/server/test_scheduler.py -q

The service must advertise flare.max_concurrency 4 and flare.prefill_chunk_size 4096 (FLARE_API_TEST_KEY is its
key, when it has one). What is checked is what helios/engine/scheduler.py promises, seen from outside:
continuous batching (a batch gives each request what it gets alone), admission (a fifth request waits or gets
429; an oversized group gets 400), chunked prefill (a long prompt never stalls running decodes for its whole
prefill), abort (a dropped stream gives its slot back) and prefix caching (a repeated prompt reports
cached_tokens). No test depends on speculative execution, so they hold for ordinary, fixed-width and adaptive
speculative services alike. Requests use raw Completions: no template or parser of any core is involved.

FLARE_SCHEDULER_TEST_LOCAL=1 runs them instead against a local CPU `helios serve` of the default core with four
model slots (its own server, since the session one has sixteen); chunk sizes are then read from its card.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from tests.server.conftest import _start, _stop

NUM_SLOTS = 4
PREFILL_CHUNK = 4096
IS_LOCAL = os.environ.get("FLARE_SCHEDULER_TEST_LOCAL") == "1"
URL = os.environ.get("FLARE_SCHEDULER_TEST_URL", "").rstrip("/")

pytestmark = pytest.mark.skipif(
    not IS_LOCAL and not (os.environ.get("FLARE_RUN_CUDA_TESTS") == "1" and URL),
    reason="needs FLARE_RUN_CUDA_TESTS=1 and FLARE_SCHEDULER_TEST_URL (or FLARE_SCHEDULER_TEST_LOCAL=1)",
)

FILLER = " The quick brown fox jumps over the lazy dog while the band plays on."
SEED = 4321
IDLE_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Service:
    url: str
    key: str
    card: dict

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"} if self.key else {}

    @property
    def num_slots(self) -> int:
        return self.card["flare"]["max_concurrency"]

    @property
    def chunk(self) -> int:
        return self.card["flare"]["prefill_chunk_size"]

    @property
    def max_model_len(self) -> int:
        return self.card["max_model_len"]

    def post(self, path: str, body: dict, timeout: float = 600) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers=self.headers(), timeout=timeout)

    def complete(self, body: dict) -> dict:
        r = self.post("/v1/completions", {"model": self.card["id"], **body})
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> dict:
        return httpx.get(self.url + "/metrics?format=json", timeout=30).json()  # unauthenticated by spec


def _card(url: str, key: str) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    r = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    [card] = r.json()["data"]
    return card


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    if IS_LOCAL:
        srv = _start(tmp_path_factory.mktemp("helios-scheduler"), "scheduler",
                     f"max_concurrency = {NUM_SLOTS}\n", "")
        try:
            svc = Service(srv.url, "", _card(srv.url, ""))
            assert svc.num_slots == NUM_SLOTS
            yield svc
        finally:
            _stop(srv.proc)
        return
    key = os.environ.get("FLARE_API_TEST_KEY", "")
    svc = Service(URL, key, _card(URL, key))
    assert (svc.num_slots, svc.chunk) == (NUM_SLOTS, PREFILL_CHUNK), (
        f"FLARE_SCHEDULER_TEST_URL must name a service with {NUM_SLOTS} request slots and a {PREFILL_CHUNK}-token "
        f"prefill chunk; this one has {svc.num_slots} and {svc.chunk}")
    yield svc


@pytest.fixture(autouse=True)
def idle(service):
    """Each test starts and ends on an idle service: nothing running, queued or holding an admission slot."""
    _wait_idle(service)
    yield
    _wait_idle(service)


def _wait_idle(svc: Service, timeout_s: float = IDLE_TIMEOUT_S) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        snap = svc.metrics()
        busy = (snap["active"], snap["pending"], snap["http_admission_in_use"])
        if busy == (0, 0, 0):
            return snap
        assert time.monotonic() < deadline, f"the service is not idle: active, pending, admission = {busy}"
        time.sleep(0.1)


def _wait_until(predicate, timeout_s: float, what: str, poll_s: float = 0.05) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def _prompt_tokens(svc: Service, text: str) -> int:
    """Prompt length in the core's tokens: max_tokens 0 tokenizes without generating."""
    return svc.complete({"prompt": text, "max_tokens": 0})["usage"]["prompt_tokens"]


def _long_prompt(svc: Service, min_tokens: int, max_tokens: int) -> tuple[str, int]:
    """A fresh prompt (a nonce first, so no earlier request shares a page of it) of min..max tokens."""
    head = f"Session {uuid.uuid4().hex}."
    num_head = _prompt_tokens(svc, head)
    per_filler = (_prompt_tokens(svc, head + FILLER * 64) - num_head) / 64
    target = (min_tokens + max_tokens) // 2
    count = max(1, round((target - num_head) / per_filler))
    for _ in range(8):  # tokenization is not exactly additive at the seams: settle in a few steps
        text = head + FILLER * count
        num = _prompt_tokens(svc, text)
        if min_tokens <= num <= max_tokens:
            return text, num
        count = max(1, count + round((target - num) / per_filler))
    pytest.fail(f"could not build a prompt of {min_tokens}..{max_tokens} tokens")


class Stream(threading.Thread):
    """One streamed completion on its own thread: the arrival time of every data event with a choice. Setting
    `stop` drops the connection at the next event, which cancels the request on the server."""

    def __init__(self, svc: Service, body: dict, stop: threading.Event | None = None):
        super().__init__(daemon=True)
        self.svc, self.body = svc, {"model": svc.card["id"], **body, "stream": True}
        self.stop = stop or threading.Event()
        self.times: list[float] = []  # monotonic arrival of each event with a choice
        self.finish_reason: str | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(600, connect=30)) as c, \
                    c.stream("POST", self.svc.url + "/v1/completions", json=self.body,
                             headers=self.svc.headers()) as r:
                if r.status_code != 200:
                    r.read()
                    self.error = AssertionError(f"HTTP {r.status_code}: {r.text}")
                    return
                for line in r.iter_lines():
                    if self.stop.is_set():
                        return  # leaving the block closes the connection: the server aborts the request
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue  # keepalive comments, blank separators, the sentinel
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    for choice in event.get("choices", []):
                        self.times.append(time.monotonic())
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except BaseException as e:  # reported by the test, not lost on the thread
            self.error = e

    def finish(self, timeout_s: float = 120) -> None:
        self.join(timeout_s)
        assert not self.is_alive(), "a stream did not end"
        if self.error is not None:
            raise self.error


def _holders(svc: Service, count: int, stop: threading.Event) -> list[Stream]:
    """`count` streams that decode until stopped (ignore_eos, a large budget), each already producing tokens."""
    body = {"prompt": f"Count from one to a thousand ({uuid.uuid4().hex}):",
            "max_tokens": min(4000, svc.max_model_len - 128),
            "ignore_eos": True, "temperature": 0, "seed": SEED}
    streams = [Stream(svc, {**body, "prompt": f"{body['prompt']} #{i}"}, stop) for i in range(count)]
    for s in streams:
        s.start()
    _wait_until(lambda: all(s.times or s.error for s in streams), 120, "every holder's first token")
    for s in streams:
        if s.error is not None:
            raise s.error
    return streams


def _release(streams: list[Stream], stop: threading.Event) -> None:
    stop.set()
    for s in streams:
        s.finish()


# --- continuous batching -----------------------------------------------------------------------------


def test_concurrent_greedy_requests_equal_sequential_ones(service):
    nonce = uuid.uuid4().hex
    bodies = [{"prompt": f"({nonce}) Story {i}: Once upon a time, in a land of {topic},", "max_tokens": 32,
               "temperature": 0, "seed": SEED}
              for i, topic in enumerate(["rivers", "mountains", "deserts", "glaciers"][:service.num_slots])]

    def outcome(r: dict) -> tuple:
        c = r["choices"][0]
        return c["text"], c["finish_reason"], r["usage"]["completion_tokens"]

    alone = [outcome(service.complete(b)) for b in bodies]
    barrier = threading.Barrier(len(bodies))

    def together(body: dict) -> tuple:
        barrier.wait()
        return outcome(service.complete(body))

    with ThreadPoolExecutor(len(bodies)) as pool:
        batched = list(pool.map(together, bodies))
    assert batched == alone


# --- admission ---------------------------------------------------------------------------------------


def test_fifth_request_waits_or_is_refused(service):
    slots = service.metrics()["http_admission_slots"]
    assert slots >= service.num_slots, "fewer HTTP admission slots than model slots"
    stop = threading.Event()
    holders = _holders(service, service.num_slots, stop)
    fifth: dict = {}
    waiter: threading.Thread | None = None
    try:
        _wait_until(lambda: service.metrics()["active"] == service.num_slots, 30, "every model slot in use")
        body = {"model": service.card["id"], "prompt": "One more:", "max_tokens": 4}
        if slots == service.num_slots:
            # exhausted admission slots: 429 at once, in the OpenAI shape
            r = service.post("/v1/completions", body, timeout=60)
            assert r.status_code == 429, r.text
            assert r.json()["error"]["type"] == "rate_limit_error"
        else:
            # a free admission slot but no model slot: the request waits in the scheduler's queue
            waiter = threading.Thread(target=lambda: fifth.update(r=service.post("/v1/completions", body)),
                                      daemon=True)
            waiter.start()
            _wait_until(lambda: service.metrics()["pending"] >= 1, 30, "the fifth request to queue")
            time.sleep(1.0)
            assert "r" not in fifth, "the fifth request ran while four others held every slot"
            assert service.metrics()["active"] == service.num_slots
    finally:
        _release(holders, stop)
    if waiter is not None:
        waiter.join(120)
        assert fifth["r"].status_code == 200, fifth["r"].text
        assert fifth["r"].json()["choices"][0]["finish_reason"] in ("stop", "length")


def test_group_larger_than_admission_slots_is_400(service):
    slots = service.metrics()["http_admission_slots"]
    if slots >= 16 * 128:
        pytest.skip(f"{slots} admission slots: a larger group would take {slots + 1} choices to build")
    n = min(128, slots + 1)  # n is at most 128; more prompts make up the rest
    num_prompts = math.ceil((slots + 1) / n)
    r = service.post("/v1/completions", {"model": service.card["id"], "prompt": ["Hi"] * num_prompts, "n": n,
                                         "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "admission" in err["message"], err


# --- chunked prefill ---------------------------------------------------------------------------------


def test_long_prefill_keeps_short_decodes_streaming(service):
    chunk, budget = service.chunk, service.max_model_len - 64
    num_chunks = min(4, budget // chunk)
    if num_chunks < 2:
        pytest.skip(f"a {service.max_model_len}-token context cannot hold two {chunk}-token prefill chunks")
    # n chunks' worth, less a page: the prompt needs every one of them
    text, num_long = _long_prompt(service, (num_chunks - 1) * chunk + chunk // 2, num_chunks * chunk - 16)
    stop = threading.Event()
    shorts = _holders(service, service.num_slots - 1, stop)
    try:
        _wait_until(lambda: all(len(s.times) >= 4 for s in shorts), 120, "steady short decodes")
        long = Stream(service, {"prompt": text, "max_tokens": 2, "temperature": 0})
        submitted = time.monotonic()
        long.start()
        _wait_until(lambda: long.times or long.error, 600, "the long prompt's first token", poll_s=0.01)
        if long.error is not None:
            raise long.error
        first = long.times[0]
        # one more event per short after the long one's first token closes every gap across the prefill
        counts = [len(s.times) for s in shorts]
        _wait_until(lambda: all(len(s.times) > n for s, n in zip(shorts, counts)), 60, "decodes after the prefill")
    finally:
        _release(shorts, stop)
    long.finish()
    prefill_s = first - submitted
    for s in shorts:
        baseline = statistics.median(b - a for a, b in zip(s.times, s.times[1:]) if b <= submitted)
        spanning = [b - a for a, b in zip(s.times, s.times[1:]) if b > submitted and a < first]
        inside = [t for t in s.times if submitted < t < first]
        # without chunking one step would prefill the whole prompt: a single gap as long as the prefill itself
        bound = max(0.75 * prefill_s, 1.0, 4 * baseline)
        assert max(spanning) <= bound, (
            f"a short decode stalled {max(spanning):.3f}s while a {num_long}-token prompt prefilled in "
            f"{prefill_s:.3f}s ({num_chunks} chunks of {chunk}; decode gap {baseline:.3f}s)")
        if num_chunks >= 3:  # each earlier chunk's step also decodes the short requests
            assert inside, f"no short decode token during a {prefill_s:.3f}s, {num_chunks}-chunk prefill"


# --- abort -------------------------------------------------------------------------------------------


def test_aborted_streams_free_their_slots(service):
    stop = threading.Event()
    _release(_holders(service, service.num_slots, stop), stop)  # every slot taken, then every stream dropped
    snap = _wait_idle(service, 30)  # native work drains, then the slots come back
    assert snap["active"] == 0
    # a following batch of four is admitted together: each has its first token before any of them ends
    batch = [Stream(service, {"prompt": f"Batch {i}:", "max_tokens": 24, "ignore_eos": True, "temperature": 0})
             for i in range(service.num_slots)]
    for s in batch:
        s.start()
    for s in batch:
        s.finish()
    assert all(s.finish_reason == "length" for s in batch)
    assert max(s.times[0] for s in batch) < min(s.times[-1] for s in batch), "the batch was not admitted at once"


# --- prefix caching ----------------------------------------------------------------------------------


def test_repeated_long_prompt_reports_cached_tokens(service):
    limit = min(service.max_model_len - 64, 2 * service.chunk)
    text, num = _long_prompt(service, min(limit, service.chunk + service.chunk // 2) - 64, limit)
    body = {"prompt": text, "max_tokens": 8, "temperature": 0, "seed": SEED}
    first = service.complete(body)
    second = service.complete(body)
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] == num
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh nonce: nothing to reuse
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 < cached < num, cached  # the last prompt token is always computed
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
