"""The intra-op thread count of CPU decode steps, chosen by timing them. Imports torch only.

On an idle CPU, more threads stream the weights faster (oneDNN splits a projection's outputs over them). On a
shared CPU every OpenMP parallel region waits at its barrier for a worker whose core another process holds,
and a decode step (a few hundred small regions) can run ten times slower than on one thread. Neither case can
be known in advance, so `DecodeThreads` times decode steps at each candidate count per batch-size bucket,
keeps the faster, and probes the other now and then (backing off while it keeps losing; at once when the
current choice has become slower than the other's last figure).

NOTE: the policy is only sound where a decode step's values do not depend on the count (every op either runs
a row on one thread or, for oneDNN's linear, splits output columns only). That holds on the 2-core CI machine
but not everywhere (a 16-core host with torch 2.11 gave other bits at batch 8), so `same_bits_across_threads`
checks it at start on the model's own weights, and the runner keeps the process's count when it fails:
otherwise a seeded request's tokens would depend on the machine's load.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator

import torch

from helios.layers.attention import decode_attention
from helios.layers.linear import linear
from helios.layers.norm import rms_norm

EMA_WEIGHT = 0.3  # weight of the newest step in the current choice's running cost


@dataclass
class _Bucket:  # one kind of step: decode-only at a batch size, or with prompt rows at a batch and token size
    cost: dict[int, float] = field(default_factory=dict)  # threads -> running seconds per step
    best: int = 0
    interval: int = 0  # steps between probes of the other count
    since_probe: int = 0


class DecodeThreads:
    """Per batch-size bucket (powers of two), the faster of 1 and `max_threads` intra-op threads; steps with prompt
    rows (prefill chunks, alone or beside decodes) in buckets of their own, by token count (powers of two).

    NOTE: the steps with prompt rows are timed too because on a shared CPU they are where two threads lose most
    (a 2-core machine at load 4-5: a 121-token SmolLM2 prefill took 5-7 s at 2 threads, ~1 s at 1, every
    elementwise region waiting for the worker whose core another process held; `helios serve` at 8 streams, whose
    prompts arrive in chunks beside the decodes, gave ITL p50 232 ms at OMP_NUM_THREADS=2 against 74 ms at 1)."""

    def __init__(self, max_threads: int, probe_interval: int = 16, max_interval: int = 512):
        assert max_threads >= 1 and 1 <= probe_interval <= max_interval
        self.candidates = sorted({max_threads, 1}, reverse=True)  # the full count is tried first
        self.probe_interval, self.max_interval = probe_interval, max_interval
        self.buckets: dict[int | tuple[str, int], _Bucket] = {}

    def choose(self, num_seqs: int, num_tokens: int | None = None) -> int:
        b = self._bucket(num_seqs, num_tokens)
        untried = [t for t in self.candidates if t not in b.cost]
        if untried:
            return untried[0]
        other = self._other(b.best)
        if other is not None and (b.since_probe >= b.interval or b.cost[b.best] > b.cost[other]):
            return other
        return b.best

    def record(self, num_seqs: int, threads: int, seconds: float, num_tokens: int | None = None) -> None:
        b = self._bucket(num_seqs, num_tokens)
        if threads == b.best:
            b.cost[threads] = (1 - EMA_WEIGHT) * b.cost[threads] + EMA_WEIGHT * seconds
            b.since_probe += 1
            return
        # a probe (or a first measurement) of the count that is not the current choice: its last figure is
        # from another time (another load), so the new one replaces it
        b.cost[threads] = seconds
        b.since_probe = 0
        if b.best == 0 or b.cost[threads] < b.cost[b.best]:
            b.best, b.interval = threads, self.probe_interval
        else:
            b.interval = min(2 * b.interval, self.max_interval)

    @contextmanager
    def run(self, num_seqs: int, num_tokens: int | None = None) -> Iterator[int]:
        """Run the block at the chosen count (restoring the process's count after) and record its time.
        num_tokens: the step's tokens when it has prompt rows (None: decode-only)."""
        threads = self.choose(num_seqs, num_tokens)
        saved = torch.get_num_threads()
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        try:
            yield threads
        finally:
            elapsed = time.perf_counter() - t0
            torch.set_num_threads(saved)
        self.record(num_seqs, threads, elapsed, num_tokens)

    def _bucket(self, num_seqs: int, num_tokens: int | None = None) -> _Bucket:
        # decode-only steps by batch size; steps with prompt rows by token count alone (their cost follows it, and
        # every bucket's first try and probes of the full count are what a loaded machine pays for)
        key: int | tuple[str, int] = (1 << max(0, num_seqs - 1).bit_length() if num_tokens is None
                                      else ("prompt", 1 << max(0, num_tokens - 1).bit_length()))
        if key not in self.buckets:
            self.buckets[key] = _Bucket(interval=self.probe_interval)
        return self.buckets[key]

    def _other(self, threads: int) -> int | None:
        return next((t for t in self.candidates if t != threads), None)


CHECK_ROWS = (1, 3, 8, 16)  # decode batch sizes the start-up check runs


def same_bits_across_threads(
    weights: list[torch.Tensor],  # the model's 2-D projection weights, [out, in] each
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_threads: int,
) -> bool:
    """True when the decode ops give identical bits at 1 and `max_threads` threads for CHECK_ROWS rows."""
    if max_threads <= 1:
        return True
    dtype = weights[0].dtype if weights else torch.float32

    def outputs(rows: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(rows)
        ys = [linear(torch.randn(rows, w.shape[1], generator=gen).to(w.dtype), w) for w in weights]
        x = torch.randn(rows, hidden_size, generator=gen).to(dtype)
        ys.append(rms_norm(x, torch.ones(hidden_size, dtype=dtype), 1e-5))
        # in the weights' dtype: 16-bit pages take their own decode path (SDPA's flash kernel)
        kv_cache = torch.randn(2, 4 * rows, 16, num_kv_heads, head_dim, generator=gen).to(dtype)
        q = torch.randn(rows, num_heads, head_dim, generator=gen).to(dtype)
        blocks = torch.randperm(4 * rows, generator=gen).view(rows, 4)
        bias = torch.zeros(rows, 1, 1, 64)
        bias[..., 50:] = float("-inf")
        ys.append(decode_attention(q, kv_cache, blocks, bias, head_dim**-0.5))
        return ys

    saved = torch.get_num_threads()
    try:
        for rows in CHECK_ROWS:
            torch.set_num_threads(1)
            one = outputs(rows)
            torch.set_num_threads(max_threads)
            many = outputs(rows)
            if not all(torch.equal(a, b) for a, b in zip(one, many)):
                return False
    finally:
        torch.set_num_threads(saved)
    return True
