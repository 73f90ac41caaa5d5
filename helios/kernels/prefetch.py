"""Pulling a weight into L2 while latency-bound kernels run: the batch-1 decode step's idle memory time.

At batch 1 the rotary + cache write and the decode attention of a layer read a few hundred KB in ~9 us while
the memory system idles; the o projection after them then streams its weight (32 MB on an 8B llama) from HBM
with a ramp at each end. `l2_prefetch(weight)` forks a side stream that pulls the weight into L2 beside those
kernels and joins it before the projection, which then reads from L2. Under CUDA graph capture the fork and
join become graph edges, so the replay runs the two branches concurrently.

The l2_prefetch switch (HELIOS_L2_PREFETCH, helios.switches) picks the mechanism, passed in as `mode`: "off" (default)
none; "bulk" the Hopper bulk prefetch instruction (cp.async.bulk.prefetch.L2, one per 8 KB); "load" plain
cache-global loads whose values are discarded.
Imports torch and helios.kernels._triton only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from helios.kernels._triton import HAS_TRITON, cdiv, interpret_mode, jit, require_triton, tl

_CHUNK = 8192  # bytes per bulk prefetch
_PER_PROGRAM = 32  # prefetches (one per lane of one warp) or load tiles per program
_LOAD_BLOCK = 2048  # int32 words per load tile: 8 KB
_SIDE: dict[int, tuple[torch.cuda.Stream, torch.Tensor]] = {}  # device -> (side stream, load sink)


@jit
def _bulk_prefetch_kernel(base_ptr, nbytes, CHUNK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = (pid * PER_PROGRAM + tl.arange(0, PER_PROGRAM)).to(tl.int64) * CHUNK
    size = tl.where(offs < nbytes, tl.minimum(nbytes - offs, CHUNK), 0).to(tl.int32)
    addr = (base_ptr + offs).to(tl.int64)
    tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
        "=r,l,r",
        [addr, size],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@jit
def _load_prefetch_kernel(words_ptr, num_words, sink_ptr, BLOCK: tl.constexpr, PER_PROGRAM: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(PER_PROGRAM):
        idx = (pid * PER_PROGRAM + i) * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(words_ptr + idx, mask=idx < num_words, other=0, cache_modifier=".cg")
    # a store no real weight triggers (the xor of 64 K words equal to this value): keeps the loads alive
    total = tl.sum(acc, axis=0)
    tl.store(sink_ptr, total, mask=total == 0x5EED1E55)


def prefetch_to_l2(weight: torch.Tensor, mode: str, sink: torch.Tensor) -> None:
    """Enqueue the L2 prefetch of `weight` (contiguous, 16-byte aligned) on the current stream; `sink` is one
    int32 the load mode may write (never, for a real weight)."""
    require_triton()
    assert weight.is_contiguous() and weight.data_ptr() % 16 == 0
    nbytes = weight.numel() * weight.element_size()
    assert nbytes % 16 == 0, f"{nbytes} bytes"
    flat = weight.view(-1).view(torch.uint8)
    if mode == "bulk":
        grid = (cdiv(nbytes, _CHUNK * _PER_PROGRAM),)
        _bulk_prefetch_kernel[grid](flat, nbytes, CHUNK=_CHUNK, PER_PROGRAM=_PER_PROGRAM, num_warps=1)
    else:
        words = flat.view(torch.int32)
        grid = (cdiv(words.numel(), _LOAD_BLOCK * _PER_PROGRAM),)
        _load_prefetch_kernel[grid](words, words.numel(), sink, BLOCK=_LOAD_BLOCK, PER_PROGRAM=_PER_PROGRAM,
                                    num_warps=4)


def _side(device: torch.device) -> tuple[torch.cuda.Stream, torch.Tensor]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SIDE:
        _SIDE[index] = (torch.cuda.Stream(device=index), torch.zeros(1, dtype=torch.int32, device=device))
    return _SIDE[index]


@contextmanager
def l2_prefetch(weight: torch.Tensor, num_tokens: int, mode: str = "off") -> Iterator[None]:
    """Prefetch `weight` into L2 on a side stream while the body's kernels run; joined on exit. Only for one
    decode row on a GPU with `mode` "bulk" or "load" (the l2_prefetch switch); otherwise nothing happens."""
    if mode not in ("bulk", "load") or num_tokens != 1 or not weight.is_cuda or not HAS_TRITON or interpret_mode():
        yield
        return
    if mode == "bulk" and torch.cuda.get_device_capability(weight.device)[0] < 9:
        mode = "load"
    main = torch.cuda.current_stream(weight.device)
    side, sink = _side(weight.device)
    fork = torch.cuda.Event()
    fork.record(main)
    side.wait_event(fork)
    with torch.cuda.stream(side):
        prefetch_to_l2(weight, mode, sink)
        done = torch.cuda.Event()
        done.record(side)
    try:
        yield
    finally:
        main.wait_event(done)
