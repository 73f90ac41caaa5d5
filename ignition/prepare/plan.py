"""The graph plan: decode batch buckets, prefill chunk size, page size, logprob outputs.

CUDA graphs cannot be persisted; the core records which shapes helios captures at start.
"""

from __future__ import annotations

from helios.core.manifest import GraphPlan

DEFAULT_PAGE_SIZE = 16
CPU_PLAN = dict(max_concurrency=16, prefill_chunk_size=512)
CUDA_PLAN = dict(max_concurrency=256, prefill_chunk_size=4096)


def decode_buckets(max_concurrency: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_concurrency (vLLM-style capture sizes)."""
    buckets = [b for b in (1, 2, 4, 8) if b <= max_concurrency]
    buckets += list(range(16, max_concurrency + 1, 16))
    if buckets[-1] != max_concurrency:
        buckets.append(max_concurrency)
    return buckets


def graph_plan(target: str, max_top_logprobs: int, context_length: int) -> GraphPlan:
    base = CUDA_PLAN if target.startswith("cuda") else CPU_PLAN
    chunk = min(base["prefill_chunk_size"], context_length)
    return GraphPlan(
        decode_buckets=decode_buckets(base["max_concurrency"]),
        prefill_chunk_size=chunk,
        max_concurrency=base["max_concurrency"],
        page_size=DEFAULT_PAGE_SIZE,
        logprob_outputs=max_top_logprobs,
    )
