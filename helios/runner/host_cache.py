"""The host DRAM tier's memory: one host tensor per layer, beside the paged KV cache, and the page copies.

Layout per layer: [2 (k, v), num_slots, page_size, num_kv_heads, head_dim], pinned when the KV pool is on CUDA.
Which hash a slot holds, and which copies a step makes, is the engine's business (helios/engine/host_cache.py;
the copies arrive in the plan); this module only owns the memory and copies what it is told.
"""

from __future__ import annotations

import torch

from helios.runner.kv_cache import KVCache


class HostKVStore:
    def __init__(self, kv_cache: KVCache, num_slots: int):
        first = kv_cache.layers[0]  # [2, num_pages, page_size, num_kv_heads, head_dim]
        self.num_slots = num_slots
        self.is_cuda = first.device.type == "cuda"
        shape = (2, num_slots, *first.shape[2:])
        # NOTE: pinned memory on CUDA: a copy between a pinned page and the GPU is a true asynchronous DMA on the
        # current stream, ordered with the forward passes around it; pageable memory would stage through a
        # bounce buffer and block the host.
        self.layers = [torch.zeros(shape, dtype=first.dtype, pin_memory=self.is_cuda) for _ in kv_cache.layers]

    def copy_out(self, kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
        """(page, slot) pairs: the pages' KV into the host records. Slots are distinct (the engine's rule)."""
        if not copies:
            return
        if self.is_cuda:
            for gpu, host in zip(kv_cache.layers, self.layers):
                for block_id, slot, n in _runs(copies):
                    for kv in range(2):  # host[kv, slot:slot + n] is contiguous pinned memory: one DMA each
                        host[kv, slot : slot + n].copy_(gpu[kv, block_id : block_id + n], non_blocking=True)
            return
        pages = torch.tensor([b for b, _ in copies])
        slots = torch.tensor([s for _, s in copies])
        for gpu, host in zip(kv_cache.layers, self.layers):
            host[:, slots] = gpu[:, pages]

    def copy_in(self, kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
        """(slot, page) pairs: the host records into the pages. Pages are distinct (each is a fresh one)."""
        if not copies:
            return
        if self.is_cuda:
            for gpu, host in zip(kv_cache.layers, self.layers):
                for slot, block_id, n in _runs(copies):
                    for kv in range(2):
                        gpu[kv, block_id : block_id + n].copy_(host[kv, slot : slot + n], non_blocking=True)
            return
        slots = torch.tensor([s for s, _ in copies])
        pages = torch.tensor([b for _, b in copies])
        for gpu, host in zip(kv_cache.layers, self.layers):
            gpu[:, pages] = host[:, slots]


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(a, b) pairs as maximal runs (a, b, n) where both sides count up by one: one copy per run."""
    runs: list[list[int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [(a, b, n) for a, b, n in runs]
