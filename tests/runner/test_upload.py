"""The weights upload (helios.runner.upload): the chunk plan as pure data (every byte once, in order, inside its
buffer, aligned), and the copy loop run through HostRing, whose deferred sends make a refill before its buffer's
wait visible as wrong bytes, over mixed dtypes, empty, odd-sized, spanning and mmap-backed tensors.
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from safetensors.torch import save_file

from helios.core.load import _map_safetensors
from helios.runner.model_runner import move_tensors
from helios.runner.upload import ALIGN, Chunk, HostRing, Piece, copy_through, plan_chunks, upload_tensors


def check_plan(sizes: list[int], buffer_bytes: int, num_buffers: int) -> list[Chunk]:
    chunks = plan_chunks(sizes, buffer_bytes, num_buffers)
    covered = [0] * len(sizes)
    order = []
    for k, chunk in enumerate(chunks):
        assert chunk.slot == k % num_buffers
        assert chunk.pieces, "a chunk carries something"
        end = 0
        for p in chunk.pieces:
            assert p.num_bytes > 0
            assert p.offset % ALIGN == 0 and p.offset >= end, "aligned, no overlap, in buffer order"
            end = p.offset + p.num_bytes
            assert end <= buffer_bytes
            assert p.start == covered[p.index], "each tensor's bytes in order, none skipped or repeated"
            covered[p.index] += p.num_bytes
            order.append((p.index, p.start))
        assert chunk.num_bytes == end
    assert covered == sizes
    assert order == sorted(order), "tensors in the given order"
    by_tensor: dict[int, list[Piece]] = {}
    for chunk in chunks:
        for p in chunk.pieces:
            by_tensor.setdefault(p.index, []).append(p)
    for index, pieces in by_tensor.items():
        if sizes[index] <= buffer_bytes:
            assert len(pieces) == 1, "a tensor that fits a buffer never spans two"
        else:
            assert all(p.offset == 0 and p.start % buffer_bytes == 0 for p in pieces)
            assert len(pieces) == -(-sizes[index] // buffer_bytes)
    return chunks


def test_plan_packs_small_tensors_and_spans_big_ones():
    chunks = check_plan([100, 5000, 0, 300, 7], buffer_bytes=1024, num_buffers=3)
    got = [(c.slot, [(p.index, p.start, p.num_bytes, p.offset) for p in c.pieces]) for c in chunks]
    assert got == [
        (0, [(0, 0, 100, 0)]),  # 5000 bytes do not fit the rest: they start the next buffer
        (1, [(1, 0, 1024, 0)]), (2, [(1, 1024, 1024, 0)]), (0, [(1, 2048, 1024, 0)]), (1, [(1, 3072, 1024, 0)]),
        (2, [(1, 4096, 904, 0)]),  # the tail leaves 120 bytes, not enough for 300 at the next aligned start
        (0, [(3, 0, 300, 0), (4, 0, 7, 512)]),
    ]


def test_plan_edges():
    assert plan_chunks([], 1024, 2) == []
    assert plan_chunks([0, 0], 1024, 2) == []
    assert [len(c.pieces) for c in check_plan([ALIGN] * 8, 4 * ALIGN, 2)] == [4, 4]
    assert [c.slot for c in check_plan([1024] * 5, 1024, 1)] == [0] * 5  # one buffer: every chunk reuses it
    check_plan([1023, 1, 1025, 2047, 2048, 1], 1024, 2)
    with pytest.raises(ValueError):
        plan_chunks([1], ALIGN - 1, 2)
    with pytest.raises(ValueError):
        plan_chunks([1], 1024, 0)


@pytest.mark.parametrize("seed", range(20))
def test_plan_random(seed):
    rng = random.Random(seed)
    buffer_bytes = rng.choice([ALIGN, 1000, 4096, 65536])
    sizes = [rng.choice([0, 1, 3, ALIGN - 1, ALIGN, buffer_bytes - 1, buffer_bytes, buffer_bytes + 1,
                         rng.randrange(1, 5 * buffer_bytes)]) for _ in range(rng.randrange(1, 40))]
    check_plan(sizes, buffer_bytes, rng.randrange(1, 5))


def mixed_tensors(tmp_path) -> dict[str, torch.Tensor]:
    """Host tensors of every kind the loader or a shard hands over: mmap-backed safetensors views (16-bit, float32,
    int32), a 0-dim, empty and odd-byte tensors, one spanning many small buffers, row slices (a storage offset) and
    a transposed view (not contiguous: the plain path)."""
    g = torch.Generator().manual_seed(0)
    on_disk = {
        "embed.weight": torch.randn(300, 64, generator=g).to(torch.bfloat16),
        "layers.0.norm.weight": torch.randn(64, generator=g),
        "layers.0.qkv.weight": torch.randn(96, 64, generator=g).to(torch.float16),
        "layers.0.ids": torch.randint(-2**31, 2**31 - 1, (13,), generator=g, dtype=torch.int32),
        "layers.0.empty": torch.empty(0, 64, dtype=torch.bfloat16),
    }
    save_file(on_disk, tmp_path / "w.safetensors")
    mapped = _map_safetensors(tmp_path / "w.safetensors")
    bits = torch.randint(0, 2**16, (4099,), generator=g, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    rows = torch.randn(40, 33, generator=g, dtype=torch.float64)
    return {
        **mapped,
        "nan_bits": bits,  # NaN and inf patterns: compared as bytes
        "scalar": torch.tensor(3.5),
        "odd": torch.randint(0, 256, (7,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(5, generator=g) > 0.5,
        "long": torch.arange(11, dtype=torch.int64),
        "empty_f32": torch.empty(3, 0),
        "rows": rows[5:17],  # contiguous, storage offset 5 * 33 doubles
        "transposed": rows.t(),
    }


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("buffer_bytes,num_buffers,num_threads",
                         [(ALIGN, 1, 0), (1024, 2, 0), (1024, 2, 1), (4096, 3, 2), (1 << 20, 4, 2)])
def test_copy_through_host_ring(tmp_path, buffer_bytes, num_buffers, num_threads):
    tensors = mixed_tensors(tmp_path)
    rings = []

    def make_ring(size, count):
        rings.append(HostRing(size, count))
        return rings[-1]

    out = copy_through(tensors, make_ring, buffer_bytes=buffer_bytes, num_buffers=num_buffers,
                       num_threads=num_threads)
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert same_bits(out[name], t), name
        if name != "transposed":
            assert out[name].is_contiguous()
            assert t.numel() == 0 or out[name].data_ptr() != t.data_ptr(), f"{name}: a copy, not the source"
    ring = rings[0]
    assert not ring.queue
    if buffer_bytes <= 4096:
        assert ring.num_sends > num_buffers and ring.num_waits > 0, "the ring was full and its buffers reused"


def test_copy_through_casts_where_asked(tmp_path):
    tensors = mixed_tensors(tmp_path)
    dtypes = {"embed.weight": torch.float32, "layers.0.norm.weight": torch.bfloat16, "transposed": torch.float32,
              "layers.0.empty": torch.float32}
    out = copy_through(tensors, HostRing, dtypes, buffer_bytes=1024, num_buffers=2, num_threads=1)
    for name, t in tensors.items():
        want = t.to(dtypes[name]) if name in dtypes else t
        assert same_bits(out[name], want), name


def test_host_ring_defers_sends_until_waited():
    # the stand-in's contract the loop is tested against: a send reads its buffer when run, not when queued
    ring = HostRing(8, 2)
    dst = torch.zeros(8, dtype=torch.uint8)
    ring.buffers[0].fill_(1)
    ring.send(0, [(dst, ring.buffers[0])])
    ring.buffers[0].fill_(2)  # a refill without wait_free(0)
    ring.synchronize()
    assert dst.tolist() == [2] * 8
    ring.send(0, [(dst, ring.buffers[0])])
    ring.send(1, [(dst, ring.buffers[1].fill_(3))])
    ring.wait_free(0)
    assert dst.tolist() == [2] * 8 and len(ring.queue) == 1 and ring.num_waits == 1


def test_move_tensors_cast_rule_off_cuda(tmp_path):
    tensors = {k: v for k, v in mixed_tensors(tmp_path).items() if v.is_floating_point()}
    for keep, pinned in ((False, False), (True, False), (True, True)):
        out = move_tensors(tensors, torch.device("cpu"), torch.bfloat16, float32_norms=keep, pinned=pinned)
        for name, t in tensors.items():
            want = t if t.dtype == torch.bfloat16 or (keep and t.dtype == torch.float32) else t.to(torch.bfloat16)
            assert same_bits(out[name], want), name
    assert upload_tensors({"x": tensors["scalar"]}, "cpu")["x"] is tensors["scalar"], "off CUDA: t.to(device)"


def test_switch_interval_during_the_loop_only(tmp_path):
    seen = []

    class Recording(HostRing):
        def wait_free(self, slot):
            seen.append(sys.getswitchinterval())
            super().wait_free(slot)

    before = sys.getswitchinterval()
    out = copy_through(mixed_tensors(tmp_path), Recording, buffer_bytes=1024, num_buffers=2, num_threads=1,
                       switch_interval_s=0.0002)
    assert seen and all(abs(s - 0.0002) < 1e-9 for s in seen)
    assert sys.getswitchinterval() == before and len(out) == len(mixed_tensors(tmp_path))
