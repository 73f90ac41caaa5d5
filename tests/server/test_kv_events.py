"""KV cache events for a prefix-aware router (issue 23) from a real `helios serve --kv-events-config`: a ZMQ SUB
socket on 127.0.0.1 decodes vLLM's wire format with vLLM's own schema (tests/engine/vllm_kv_schema.py, as vLLM's
example subscriber declares it) and sees a prompt's full pages stored under the hashes a second identical prompt reuses,
their removal when other traffic evicts them, consecutive sequence numbers, and the replay socket's history
(AllBlocksCleared first).

NOTE: the served core is the default one with its context capped at 128 tokens (a copy of core.toml with the limits
and prefill chunk `ignition build --context-length 128` writes, the other files linked): on the CPU the KV pool holds
the context length, so 8 pages here, and one 113-token prompt evicts every cached page.
"""

from __future__ import annotations

import json
import random
import subprocess
import time

import httpx
import msgspec
import pytest

from helios.core.manifest import MANIFEST_FILE, decode_manifest, encode_manifest
from helios.engine.prefix_cache import extend_page_hashes
from helios.server.config import load_config
from tests.engine.vllm_kv_schema import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tests.server.conftest import CORE, HELIOS, _free_port, _stop, serve_core

zmq = pytest.importorskip("zmq")

CONTEXT = 128
PAGE = 16
TOPIC = "kv@test-pod@smollm2"
DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def _capped_core(out, context: int):
    """The default core with its serving context capped (limits and prefill chunk as ignition writes them), its
    files linked."""
    for item in CORE.rglob("*"):
        if item.is_file() and item.name != MANIFEST_FILE:
            link = out / item.relative_to(CORE)
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to(item)
    manifest = decode_manifest((CORE / MANIFEST_FILE).read_bytes())
    limits = msgspec.structs.replace(manifest.limits, context_length=context,
                                     default_max_tokens=min(manifest.limits.default_max_tokens, context))
    plan = msgspec.structs.replace(manifest.graph_plan,
                                   prefill_chunk_size=min(manifest.graph_plan.prefill_chunk_size, context))
    (out / MANIFEST_FILE).write_bytes(encode_manifest(msgspec.structs.replace(manifest, limits=limits,
                                                                              graph_plan=plan)))
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(url, SUB socket, replay endpoint): the server connects its PUB socket to the test's bound SUB socket."""
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    tmp = tmp_path_factory.mktemp("kv-events")
    core = _capped_core(tmp / "core", CONTEXT)
    config = tmp / "helios.toml"
    config.write_text("[server]\nkv_cache_tokens = 16\nmax_concurrency = 1\n", encoding="utf-8")
    ctx = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        sub.setsockopt(zmq.LINGER, 0)
        port = sub.bind_to_random_port("tcp://127.0.0.1")
        replay = f"tcp://127.0.0.1:{_free_port()}"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}",
                  "replay_endpoint": replay, "topic": TOPIC}
        proc, url = serve_core(core, config, tmp / "serve.log", ("--kv-events-config", json.dumps(events)))
        # NOTE: a bound SUB socket sends its subscription to a connected PUB only once this thread calls into it
        sub.poll(200)
        try:
            yield url, sub, replay
        finally:
            _stop(proc)
    finally:
        ctx.destroy(linger=0)


END_SEQ = (-1).to_bytes(8, "big", signed=True)


def replay(endpoint: str, start: int) -> list[tuple[int, KVEventBatch]]:
    """Every buffered batch from sequence number `start`, from the ROUTER replay socket: a DEALER with REQ's
    framing (an empty delimiter), one request, a stream of answers, END_SEQ last."""
    with zmq.Context() as ctx, ctx.socket(zmq.DEALER) as dealer:
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        dealer.send_multipart((b"", start.to_bytes(8, "big")))
        batches = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            empty, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                return batches
            batches.append((int.from_bytes(seq, "big"), DECODER.decode(payload)))


class Received:
    """The batches seen so far by sequence number: live from the SUB socket, and those it missed (a PUB drops what
    it sends before a subscription reaches it) from the replay socket, as vLLM's example subscriber does."""

    def __init__(self, sub, replay_endpoint: str) -> None:
        self.sub = sub
        self.replay_endpoint = replay_endpoint
        self.batches: dict[int, KVEventBatch] = {}
        self.live: list[int] = []  # sequence numbers in arrival order on the SUB socket

    @property
    def next_seq(self) -> int:
        return max(self.batches, default=-1) + 1

    def events(self, start: int = 0) -> list:
        return [e for seq in sorted(self.batches) if seq >= start for e in self.batches[seq].events]

    def until(self, predicate, what: str, timeout_s: float = 20.0) -> None:
        """Receive until predicate(self) holds; after 0.5 s without a message, fill the gaps from the replay."""
        deadline = time.monotonic() + timeout_s
        quiet_since = time.monotonic()
        while not predicate(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; got {self.events()}")
            if self.sub.poll(100):
                topic, seq, payload = self.sub.recv_multipart()
                assert topic == TOPIC.encode()
                self.live.append(int.from_bytes(seq, "big"))
                self.batches[self.live[-1]] = DECODER.decode(payload)
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since > 0.5:
                self.fill()
                quiet_since = time.monotonic()

    def fill(self) -> None:
        """Ask the replay socket for every batch from the first sequence number not held."""
        first_missing = next(i for i in range(self.next_seq + 1) if i not in self.batches)
        self.batches.update((seq, b) for seq, b in replay(self.replay_endpoint, first_missing)
                            if seq not in self.batches)


def _complete(url: str, prompt: list[int]) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def _stored(received: Received, start: int = 0) -> list[bytes]:  # hashes stored from sequence number `start`
    return [h for e in received.events(start) if isinstance(e, BlockStored) for h in e.block_hashes]


def _removed(received: Received) -> set[bytes]:
    return {h for e in received.events() if isinstance(e, BlockRemoved) for h in e.block_hashes}


def test_pages_stored_reused_and_evicted(served):
    url, sub, replay_endpoint = served
    rng = random.Random(23)
    received = Received(sub, replay_endpoint)
    prompt = [rng.randrange(1000, 40000) for _ in range(2 * PAGE + 5)]  # 2 full pages and a partial one
    hashes: list[bytes] = []
    extend_page_hashes(hashes, prompt, PAGE, 2)
    assert _complete(url, prompt)["prompt_tokens_details"]["cached_tokens"] == 0
    received.until(lambda r: set(hashes) <= set(_stored(r)), "the prompt's pages to be stored")
    (stored,) = [e for e in received.events() if isinstance(e, BlockStored) and hashes[0] in e.block_hashes]
    assert stored.block_hashes == hashes and stored.parent_block_hash is None  # one run from the sequence start
    assert stored.token_ids == prompt[:2 * PAGE] and stored.block_size == PAGE
    assert stored.lora_id is None and stored.medium == "GPU"

    # the same prompt reuses exactly the announced pages, and announces none of them again
    mark = received.next_seq
    assert _complete(url, prompt)["prompt_tokens_details"]["cached_tokens"] == 2 * PAGE
    other = [rng.randrange(1000, 40000) for _ in range(2 * PAGE)]
    other_hashes: list[bytes] = []
    extend_page_hashes(other_hashes, other, PAGE, 1)  # 32 tokens: 1 page computed (the last token never is)
    _complete(url, other)
    received.until(lambda r: other_hashes[0] in _stored(r, mark), "a later prompt's page (events are in order)")
    assert not set(hashes) & set(_stored(received, mark))

    # a prompt as large as the whole pool (8 pages) evicts every cached page
    big = [rng.randrange(1000, 40000) for _ in range(CONTEXT - PAGE + 1)]
    _complete(url, big)
    received.until(lambda r: set(hashes + other_hashes) <= _removed(r), "the evicted pages to be removed")
    removed = [e for e in received.events() if isinstance(e, BlockRemoved)]
    assert all(e.medium == "GPU" for e in removed)

    received.fill()
    live = received.live
    assert len(live) >= 3 and live == list(range(live[0], live[0] + len(live)))  # one PUB stream, nothing dropped
    assert sorted(received.batches) == list(range(received.next_seq))  # with the replay: every batch from 0
    assert all(batch.data_parallel_rank == 0 and batch.ts > 0 for batch in received.batches.values())


def test_replay_returns_the_history_from_a_sequence_number(served):
    batches = replay(served[2], 0)
    assert [seq for seq, _ in batches] == list(range(len(batches)))
    assert isinstance(batches[0][1].events[0], AllBlocksCleared)  # the engine's first batch: a fresh cache
    assert any(isinstance(e, BlockStored) for _, batch in batches for e in batch.events)
    assert [seq for seq, _ in replay(served[2], 2)] == list(range(2, len(batches)))


def test_the_config_file_and_the_flag_take_vllm_fields(tmp_path):
    config = tmp_path / "helios.toml"
    config.write_text("[server]\n[server.kv_events]\nenable_kv_cache_events = true\nendpoint = 'tcp://indexer:5557'\n"
                      "topic = 'kv@pod@model'\n", encoding="utf-8")
    events = load_config(config).server.kv_events
    assert events.is_publishing and events.publisher is None and events.replay_endpoint is None
    assert (events.endpoint, events.topic, events.buffer_steps) == ("tcp://indexer:5557", "kv@pod@model", 10_000)
    assert not msgspec.structs.replace(events, publisher="null").is_publishing
    if not (CORE / "core.toml").is_file():
        pytest.skip(f"the default core is not built ({CORE}); run `make core`")
    bad = subprocess.run([str(HELIOS), "serve", str(CORE), "--kv-events-config",
                          '{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}'],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-events-config: Object contains unknown field `endpont`" in bad.stderr
