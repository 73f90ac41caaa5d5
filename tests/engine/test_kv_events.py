"""KV cache events (helios/engine/kv_events.py) against the engine's own truth: a router's index built from nothing but
the published batches (decoded from msgpack with vLLM's schema, as tests/server/test_kv_events.py does) names
exactly the pages the GPU pool holds a hash for, after every step of random traffic that evicts, preempts, aborts,
restores pages from the host tier and fails plans; every BlockStored's hashes chain from its parent over its
tokens. No ZMQ here: a list stands for the publisher."""

from __future__ import annotations

import random

import msgspec
import pytest

from helios.engine.config import SchedulerConfig
from helios.engine.engine_core import EngineCore, RequestExecutionError
from helios.engine.kv_events import KVEventBatch
from helios.engine.messages import EngineRequest, SamplingParams
from helios.engine.prefix_cache import ROOT_HASH, hash_page
from helios.engine.scheduler import QueueFull
from tests.engine.fakes import FakeRunner, run_until_idle
from tests.engine.vllm_kv_schema import AllBlocksCleared, BlockRemoved, BlockStored
from tests.engine.vllm_kv_schema import KVEventBatch as VllmBatch

PAGE = 4
WIRE = msgspec.msgpack.Decoder(VllmBatch)


class ListPublisher:
    """The publisher's contract without a socket: each step's events, encoded and decoded as on the wire."""

    def __init__(self) -> None:
        self.batches: list[VllmBatch] = []
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events) -> None:
        payload = self._encoder.encode(KVEventBatch(ts=1.0, events=events, data_parallel_rank=0))
        self.batches.append(WIRE.decode(payload))


class RouterIndex:
    """What a subscriber knows: the hashes stored and not removed since the last AllBlocksCleared."""

    def __init__(self) -> None:
        self.hashes: set[bytes] = set()
        self.ever: set[bytes] = set()
        self.num_batches = 0

    def apply(self, batches: list[VllmBatch]) -> None:
        for batch in batches[self.num_batches:]:
            for event in batch.events:
                if isinstance(event, AllBlocksCleared):
                    self.hashes.clear()
                elif isinstance(event, BlockStored):
                    self._check_chain(event)
                    assert not set(event.block_hashes) & self.hashes, "stored twice without a removal"
                    self.hashes.update(event.block_hashes)
                    self.ever.update(event.block_hashes)
                else:
                    assert isinstance(event, BlockRemoved) and event.medium == "GPU"
                    assert set(event.block_hashes) <= self.hashes, "removed without being stored"
                    self.hashes.difference_update(event.block_hashes)
        self.num_batches = len(batches)

    def _check_chain(self, event: BlockStored) -> None:
        assert event.block_size == PAGE and len(event.token_ids) == PAGE * len(event.block_hashes)
        assert event.parent_block_hash is None or event.parent_block_hash in self.ever
        parent = event.parent_block_hash or ROOT_HASH
        for i, block_hash in enumerate(event.block_hashes):
            parent = hash_page(parent, event.token_ids[i * PAGE:(i + 1) * PAGE])
            assert block_hash == parent


def make_core(publisher, fail=None, **config) -> EngineCore:
    defaults = dict(max_concurrency=3, max_num_batched_tokens=24, prefill_chunk_size=8, page_size=PAGE,
                    num_pages=14, host_cache_pages=10, page_bytes=1, max_model_len=48, max_waiting=6)
    cfg = SchedulerConfig(**{**defaults, **config})
    return EngineCore(cfg, FakeRunner(PAGE, fail=fail), kv_events=publisher)


def assert_index_is_the_pool(core: EngineCore, index: RouterIndex, publisher: ListPublisher) -> None:
    index.apply(publisher.batches)
    pool = core.scheduler.block_pool
    assert pool.num_cached_blocks == len(index.hashes)
    assert all(pool.cached_block(h) is not None for h in index.hashes)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_router_index_built_from_events_is_the_pool(seed):
    rng = random.Random(seed)
    failing = [False]

    def fail(plan):
        if failing[0] and plan.scheduled:
            failing[0] = False
            return RequestExecutionError([plan.scheduled[0].req_id] if rng.random() < 0.5 else [], "injected")
        return None

    publisher = ListPublisher()
    core = make_core(publisher, fail=fail)
    index = RouterIndex()
    heads = [[rng.randrange(10, 1000) for _ in range(40)] for _ in range(3)]  # shared prefixes come back
    added: list[str] = []
    for step in range(250):
        roll = rng.random()
        if roll < 0.3:
            head = rng.choice(heads)
            prompt = head[:rng.randrange(5, 30)] + [rng.randrange(10, 1000) for _ in range(rng.randrange(0, 6))]
            rid = f"r{len(added)}"
            try:
                core.add_request(EngineRequest(req_id=rid, prompt_token_ids=prompt,
                                               sampling=SamplingParams(max_tokens=rng.randrange(1, 10))))
                added.append(rid)
            except (QueueFull, ValueError):
                pass
        elif roll < 0.35 and added:
            core.abort(rng.choice(added))
        elif roll < 0.4:
            failing[0] = True
        core.step()
        assert_index_is_the_pool(core, index, publisher)
    failing[0] = False
    run_until_idle(core)
    assert_index_is_the_pool(core, index, publisher)
    assert isinstance(publisher.batches[0].events[0], AllBlocksCleared)
    assert any(isinstance(e, BlockRemoved) for b in publisher.batches for e in b.events), "nothing was evicted"
    m = core.metrics()
    assert m.host_hits > 0, "no page came back from the host tier"


def test_no_events_without_a_publisher_or_a_prefix_cache():
    quiet = make_core(None)
    assert quiet.scheduler.block_pool.events is None and quiet.scheduler.prefix_cache.events is None
    publisher = ListPublisher()
    off = make_core(publisher, enable_prefix_caching=False, host_cache_pages=0)
    off.add_request(EngineRequest(req_id="a", prompt_token_ids=list(range(10, 30)),
                                  sampling=SamplingParams(max_tokens=3)))
    run_until_idle(off)
    assert off.kv_events is None and publisher.batches == []
