"""The CPU KV pool's memory (helios.runner.kv_cache.zeros): zeros without writing them at start-up. The default CPU
core's 32768-token pool is 1.5 GB, which torch.zeros spent 0.72 s writing and held resident from the start; from an
anonymous private map, it costs neither until a page is written, and a forked process's writes stay its own."""

from __future__ import annotations

import os

import pytest
import torch

from helios.runner.kv_cache import LAZY_ZEROS_BYTES, KVCache, zeros


def resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_a_cpu_pool_is_zeros_held_only_where_written():
    before = resident_mb()
    cache = KVCache(num_layers=4, num_pages=2048, page_size=16, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    layer_mb = cache.layers[0].numel() * 2 / 2**20  # 32 MB a layer, 128 MB in all
    cache.layers[2][1, 7] = 3.0  # one page of layer 2's values
    assert resident_mb() - before < layer_mb / 4
    # NOTE: read after the measure: a reduction's temporaries would count too
    assert [int(torch.count_nonzero(t)) for t in cache.layers] == [0, 0, 16 * 4 * 64, 0]
    assert cache.layers[2][1, 7].float().sum().item() == 3.0 * 16 * 4 * 64


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_process_writes_its_own_copy():
    pool = zeros((4, LAZY_ZEROS_BYTES), torch.uint8, "cpu")
    view = pool.numpy()  # NOTE: no torch op in the child: a forked OpenMP runtime can hang in its first parallel op
    pid = os.fork()
    if pid == 0:
        view[1] = 5
        os._exit(0)
    os.waitpid(pid, 0)
    assert not pool.any()


def test_small_and_device_tensors_are_torch_zeros():
    small = zeros((3, 5), torch.float32, "cpu")
    assert torch.equal(small, torch.zeros(3, 5)) and small.is_contiguous()
    meta = zeros((2, 1 << 20), torch.float32, "meta")
    assert meta.device.type == "meta" and meta.shape == (2, 1 << 20)
