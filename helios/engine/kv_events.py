"""KV cache events for a prefix-aware router (issue 23): vLLM's wire format, recorded per step, sent off-thread.

A router such as llm-d's precise prefix-cache scorer (llm-d-kv-cache) keeps an index of which replica holds which
KV pages by subscribing to each replica's events. vLLM's format, kept exactly (`--kv-events-config`): a ZMQ PUB
socket sends multipart messages (topic, 8-byte big-endian sequence number, msgpack payload); the payload is a
`KVEventBatch` (ts, events, data_parallel_rank) of msgspec array-like tagged structs `BlockStored`,
`BlockRemoved` and `AllBlocksCleared`; an optional ROUTER socket replays buffered batches from a sequence number.

KVEventLog is filled by the prefix cache's hooks (helios/engine/prefix_cache.py, block_pool.py) on the engine
thread and emptied once per step by EngineCore into a publisher; ZmqEventPublisher encodes and sends on a thread of
its own, so the step loop never waits on a socket. Pure Python: must not import torch or numpy (pyzmq is imported
only when a ZMQ publisher is built).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence

import msgspec
from msgspec import Struct

logger = logging.getLogger("helios.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's name for the device KV pool; llm-d reads it as device tier "gpu"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's last frame


class KVCacheEvent(Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events: on the wire each is an array whose first element is its class name."""


class BlockStored(KVCacheEvent):
    """Consecutive full pages of one sequence became reusable: their hashes (each chained from the one before,
    the first from `parent_block_hash`; None at a sequence's start) and their tokens, `block_size` per page."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    """Pages no longer reusable (evicted for another allocation, or dropped after a failed copy-in)."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """Nothing cached any more: sent when the engine starts, so a restarted replica's old pages are forgotten."""


class KVEventBatch(Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, oldest first; the payload of one PUB message."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventLog:
    """The prefix cache's changes since the last take(), in the order they happened. Engine thread only."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = []

    def stored(self, page_hashes: Sequence[bytes], token_ids: Sequence[int], pages: Sequence[int]) -> None:
        """Pages `pages` (ascending indexes into one sequence's `page_hashes`) were newly cached: one BlockStored
        per run of consecutive pages, parented on the page before the run."""
        size = self.block_size
        i = 0
        while i < len(pages):
            j = i + 1
            while j < len(pages) and pages[j] == pages[j - 1] + 1:
                j += 1
            first, end = pages[i], pages[j - 1] + 1
            self._events.append(BlockStored(
                block_hashes=list(page_hashes[first:end]), parent_block_hash=page_hashes[first - 1] if first else None,
                token_ids=list(token_ids[first * size:end * size]), block_size=size, lora_id=None, medium=MEDIUM_GPU))
            i = j

    def removed(self, block_hash: bytes) -> None:
        """One page lost its hash; removals in a row share one event."""
        last = self._events[-1] if self._events else None
        if type(last) is BlockRemoved:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved(block_hashes=[block_hash], medium=MEDIUM_GPU))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


def _binds(endpoint: str) -> bool:
    """vLLM's rule, so its endpoints mean the same here: a wildcard or a local transport binds, anything else
    connects (a subscriber that binds, such as llm-d's static-endpoint indexer, is connected to)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Sends each step's KVEventBatch on a ZMQ PUB socket from a thread of its own; keeps the last
    `buffer_steps` payloads for the ROUTER replay socket. publish() never blocks: beyond `max_queue_size` waiting
    batches it drops the batch (counted in `num_dropped`, warned once), and the PUB socket itself drops beyond
    `hwm` per slow subscriber, as ZMQ does."""

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000, max_queue_size: int = 100_000,
                 data_parallel_rank: int = 0) -> None:
        import zmq  # optional dependency (the `kv-events` extra): only a server that publishes needs it

        self._zmq = zmq
        # NOTE: a context of our own: closing it cannot touch another library's sockets. The sockets are made
        # and bound here, so a taken port fails the start-up, and from then on only the sender thread uses them
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        (self._pub.bind if _binds(endpoint) else self._pub.connect)(endpoint)
        self._replay = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(replay_endpoint)
        self._topic = topic.encode("utf-8")
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.num_dropped = 0
        self._thread = threading.Thread(target=self._run, name="helios-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Hand one step's events to the sender thread (engine thread; never waits)."""
        try:
            self._queue.put_nowait(KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self._rank))
        except queue.Full:
            if not self.num_dropped:
                logger.warning("KV events: the send queue is full, dropping batches (a router's index goes stale)")
            self.num_dropped += 1

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to `timeout_s`), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        if not self._thread.is_alive():  # a thread still sending keeps its sockets; the process is ending anyway
            self._ctx.destroy(linger=0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
            except Exception:  # a send error must not end the thread: later batches still go out
                logger.exception("KV events: sending batch %d failed", seq)

    def _serve_replay(self) -> None:
        """One replay request (a REQ/DEALER client's [identity, b"", start seq]): every buffered batch from that
        sequence number, then END_SEQ."""
        try:
            frames = self._replay.recv_multipart()
            if len(frames) != 3:
                logger.warning("KV events: malformed replay request of %d frames", len(frames))
                return
            identity, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
            self._replay.send_multipart((identity, b"", END_SEQ, b""))
        except Exception:
            logger.exception("KV events: serving a replay failed")
