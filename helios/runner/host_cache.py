"""The host DRAM tier's memory: one host tensor per layer, beside the paged KV cache, and the page copies.

Layout per layer: the KV layer's with num_slots in place of num_pages ([2 (k, v), num_slots, page_size, num_kv_heads,
head_dim], or an MLA layer's [1, num_slots, page_size, latent]), pinned when the KV pool is on CUDA.
Which hash a slot holds, and which copies a step makes, is the engine's business (helios/engine/host_cache.py;
the copies arrive in the plan); this module only owns the memory and copies what it is told.
"""

from __future__ import annotations

import torch

from helios.runner.kv_cache import KVCache


class HostKVStore:
    def __init__(self, kv_cache: KVCache, num_slots: int):
        self.num_slots = num_slots
        self.is_cuda = kv_cache.layers[0].device.type == "cuda"
        # NOTE: pinned memory on CUDA: a copy between a pinned page and the GPU is a true asynchronous DMA on the
        # current stream, ordered with the forward passes around it; pageable memory would stage through a
        # bounce buffer and block the host.
        self.layers = [torch.zeros((layer.shape[0], num_slots, *layer.shape[2:]), dtype=layer.dtype,
                                   pin_memory=self.is_cuda) for layer in kv_cache.paged_tensors]

    def copy_out(self, kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
        """(page, slot) pairs: the pages' KV into the host records. Slots are distinct (the engine's rule)."""
        _copy(kv_cache.paged_tensors, self.layers, copies, self.is_cuda)

    def copy_in(self, kv_cache: KVCache, copies: list[tuple[int, int]]) -> None:
        """(slot, page) pairs: the host records into the pages. Pages are distinct (each is a fresh one)."""
        _copy(self.layers, kv_cache.paged_tensors, copies, self.is_cuda)


def _copy(sources: list[torch.Tensor], targets: list[torch.Tensor], copies: list[tuple[int, int]],
          is_cuda: bool) -> None:
    """(source index, target index) pairs along dim 1 of each layer's [2 or 1, pages or slots, ...] tensor. On CUDA,
    one non-blocking copy per run of consecutive pairs and k/v half or latent (a slot range is contiguous pinned
    memory: one DMA each); on the CPU, one indexed copy per layer."""
    if not copies:
        return
    if is_cuda:
        runs = _runs(copies)
        for source, target in zip(sources, targets):
            for a, b, n in runs:
                for kv in range(source.shape[0]):
                    target[kv, b : b + n].copy_(source[kv, a : a + n], non_blocking=True)
        return
    index_from = torch.tensor([a for a, _ in copies])
    index_to = torch.tensor([b for _, b in copies])
    for source, target in zip(sources, targets):
        target[:, index_to] = source[:, index_from]


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(a, b) pairs as maximal runs (a, b, n) where both sides count up by one: one copy per run."""
    runs: list[list[int]] = []
    for a, b in pairs:
        if runs and runs[-1][0] + runs[-1][2] == a and runs[-1][1] + runs[-1][2] == b:
            runs[-1][2] += 1
        else:
            runs.append([a, b, 1])
    return [(a, b, n) for a, b, n in runs]
