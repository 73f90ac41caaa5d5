"""The weights upload: host tensors (the core's mmap-backed weights) to a CUDA device through a small ring of pinned
staging buffers, so the copy engine reads pinned memory at the link's speed instead of the driver's pageable path.

Follows the chunk plan of helios.runner.upload_plan (re-exported here); owns the copy loop (`copy_through`) and its
two rings: `CudaRing` (pinned buffers, a side stream, an event per buffer) and `HostRing`, the CPU stand-in that tests
run the same loop through. Imports torch only; knows nothing of models or cores.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch

from helios.runner.upload_plan import ALIGN, Chunk, Piece, plan_chunks, staged_bytes  # noqa: F401 (re-exported)

BUFFER_BYTES = 64 << 20
NUM_BUFFERS = 4
NUM_THREADS = 2  # host threads filling buffers (0: the calling thread fills each one itself)
SWITCH_INTERVAL_S = 0.0005  # the interpreter's GIL switch interval while the loop runs (see copy_through)


def can_stage(t: torch.Tensor) -> bool:
    """Whether the loop can copy t as flat bytes: a dense, contiguous host tensor (no lazy conj/neg bit, no grad)."""
    return (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized and t.is_contiguous()
            and not t.is_conj() and not t.is_neg() and not t.requires_grad)


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class CudaRing:
    """Pinned staging buffers (one host allocation), a side stream for the copies, and an event per buffer recorded
    after each copy out of it, so a buffer is refilled only once the copy engine has read it."""

    def __init__(self, device: torch.device, buffer_bytes: int, num_buffers: int):
        self.device = device
        self.buffers = torch.empty(num_buffers * buffer_bytes, dtype=torch.uint8, pin_memory=True).view(
            num_buffers, buffer_bytes)
        self.stream = torch.cuda.Stream(device)
        self.events = [torch.cuda.Event() for _ in range(num_buffers)]

    def empty(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device=self.device)

    def order_after_allocations(self) -> None:
        # NOTE: the allocator hands out blocks on the current stream, maybe ones still read by work queued there
        # (a cast's source, freed): the side stream writes them only after that work.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def send(self, slot: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        with torch.cuda.stream(self.stream):
            torch._foreach_copy_([dst for dst, _ in copies], [src for _, src in copies], non_blocking=True)
            self.events[slot].record(self.stream)

    def wait_free(self, slot: int) -> None:
        self.events[slot].synchronize()  # releases the GIL; returns at once for an event never recorded

    def wait_sent(self, slot: int) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.events[slot])

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self) -> None:
        del self.buffers
        empty_host_cache = getattr(torch._C, "_host_emptyCache", None)
        if empty_host_cache is not None:  # torch keeps freed pinned blocks cached; give ours back to the OS
            empty_host_cache()


class HostRing:
    """The CPU stand-in for CudaRing (tests, benchmarks/gpu_upload.py --dry): plain buffers, and each send deferred
    like a copy engine's queue, run in order only when its buffer is waited for or the ring synchronizes; a loop
    that refilled a buffer before waiting for it would send the new bytes here too."""

    device = torch.device("cpu")

    def __init__(self, buffer_bytes: int, num_buffers: int):
        self.buffers = torch.empty(num_buffers * buffer_bytes, dtype=torch.uint8).view(num_buffers, buffer_bytes)
        self.queue: deque[tuple[int, list[tuple[torch.Tensor, torch.Tensor]]]] = deque()
        self.num_sends = 0
        self.num_waits = 0  # sends that were still queued when a wait_free ran them (the ring was full)

    def empty(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype)

    def order_after_allocations(self) -> None:
        pass

    def send(self, slot: int, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.queue.append((slot, copies))
        self.num_sends += 1

    def wait_free(self, slot: int) -> None:
        self.num_waits += self._run_through(slot)

    def wait_sent(self, slot: int) -> None:
        self._run_through(slot)

    def synchronize(self) -> None:
        while self.queue:
            self._run_one()

    def close(self) -> None:
        del self.buffers

    def _run_through(self, slot: int) -> int:
        """Run the queued sends up to the last one from `slot`; how many ran."""
        last = max((i for i, (s, _) in enumerate(self.queue) if s == slot), default=-1)
        for _ in range(last + 1):
            self._run_one()
        return last + 1

    def _run_one(self) -> None:
        _, copies = self.queue.popleft()
        for dst, src in copies:
            dst.copy_(src)


Ring = CudaRing | HostRing


def move_each(tensors: Mapping[str, torch.Tensor], device: torch.device,
              dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The plain path, one `.to(device)` per tensor (pageable copies through the driver), then the cast there."""
    out = {}
    for name, t in tensors.items():
        t = t.to(device, non_blocking=True)
        out[name] = t.to(dtypes[name]) if name in dtypes else t
    return out


def copy_through(tensors: Mapping[str, torch.Tensor], make_ring: Callable[[int, int], Ring],
                 dtypes: Mapping[str, torch.dtype] | None = None, buffer_bytes: int = BUFFER_BYTES,
                 num_buffers: int = NUM_BUFFERS, num_threads: int = NUM_THREADS,
                 switch_interval_s: float | None = SWITCH_INTERVAL_S) -> dict[str, torch.Tensor]:
    """`tensors` on make_ring(buffer_bytes, num_buffers)'s device, in the same order, each contiguous, with its
    bytes; those named in `dtypes` then cast to that dtype there. Tensors that can_stage rejects take move_each.

    The loop, per chunk: wait until its buffer's last copy is done, fill it on the host (num_threads threads,
    each filling chunks ahead; torch's CPU copy_ releases the GIL and runs on the intra-op threads), then send it
    (async copies). Sources go in address order (each file read front to back).

    NOTE: each chunk releases the GIL around its fill and its wait (one torch call each: _foreach_copy_); with
    the default 5 ms switch interval, a busy Python thread beside (the kernel load) holds the GIL up to 5 ms
    every time, several times a ~3 ms chunk. The loop runs at switch_interval_s (None: as set) and restores it."""
    dtypes = dtypes or {}
    names = sorted((n for n, t in tensors.items() if can_stage(t) and t.numel() > 0),
                   key=lambda n: tensors[n].data_ptr())
    staged = _Staged(tensors, names, dtypes)
    chunks = plan_chunks(staged.sizes, min(buffer_bytes, staged.bound), num_buffers)
    ring = make_ring(min(buffer_bytes, staged.bound), max(1, min(num_buffers, len(chunks))))
    try:
        out = move_each({n: t for n, t in tensors.items() if n not in staged.index}, ring.device, dtypes)
        staged.allocate(ring)
        with _switch_interval(switch_interval_s):
            _run(chunks, ring, staged.fill, staged.send, num_threads)
    finally:
        ring.synchronize()
        ring.close()
    out.update(staged.out)
    return {n: out[n] for n in tensors}


class _Staged:
    """The tensors copy_through stages, in address order: their bytes, their device targets, and the finished
    tensors. Targets are allocated up front, except those to be cast: at their first piece, so only the tensors
    in flight exist in both dtypes."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], names: list[str], dtypes: Mapping[str, torch.dtype]):
        self.tensors, self.names, self.dtypes = tensors, names, dtypes
        self.index = {n: i for i, n in enumerate(names)}
        self.sources = [_as_bytes(tensors[n]) for n in names]
        self.sizes = [s.numel() for s in self.sources]
        self.bound = staged_bytes(self.sizes)  # no buffer needs more
        self.targets: list[torch.Tensor | None] = []
        self.out: dict[str, torch.Tensor] = {}

    def allocate(self, ring: Ring) -> None:
        self.ring = ring
        self.targets = [None if n in self.dtypes else ring.empty(self.tensors[n]) for n in self.names]
        ring.order_after_allocations()

    def fill(self, chunk: Chunk) -> Chunk:
        buffer = self.ring.buffers[chunk.slot]
        torch._foreach_copy_([buffer.narrow(0, p.offset, p.num_bytes) for p in chunk.pieces],
                             [self.sources[p.index].narrow(0, p.start, p.num_bytes) for p in chunk.pieces])
        return chunk

    def send(self, chunk: Chunk) -> None:
        ring, targets = self.ring, self.targets
        fresh = [p.index for p in chunk.pieces if targets[p.index] is None]
        for i in fresh:
            targets[i] = ring.empty(self.tensors[self.names[i]])
        if fresh:
            ring.order_after_allocations()
        buffer = ring.buffers[chunk.slot]
        ring.send(chunk.slot, [(_as_bytes(targets[p.index]).narrow(0, p.start, p.num_bytes),
                                buffer.narrow(0, p.offset, p.num_bytes)) for p in chunk.pieces])
        for p in chunk.pieces:
            if p.start + p.num_bytes == self.sizes[p.index]:  # the tensor's last piece
                name, target = self.names[p.index], targets[p.index]
                if name in self.dtypes:
                    ring.wait_sent(chunk.slot)
                    target = target.to(self.dtypes[name])
                self.out[name], targets[p.index] = target, None


@contextmanager
def _switch_interval(seconds: float | None) -> Iterator[None]:
    before = sys.getswitchinterval()
    if seconds is not None:
        sys.setswitchinterval(seconds)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


def _run(chunks: list[Chunk], ring: Ring, fill: Callable[[Chunk], Chunk], send: Callable[[Chunk], None],
         num_threads: int) -> None:
    """Fill and send every chunk in order, at most `lookahead` filled or filling ahead of the last send.

    NOTE: with lookahead <= num_buffers - 1, the chunk that last used a buffer has always been sent (its event
    recorded) when the loop waits to refill that buffer."""
    if num_threads <= 0:
        for chunk in chunks:
            ring.wait_free(chunk.slot)
            send(fill(chunk))
        return
    lookahead = max(1, min(num_threads, len(ring.buffers) - 1))
    pending: deque[Future[Chunk]] = deque()
    with ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="helios-upload") as pool:
        try:
            for chunk in chunks:
                ring.wait_free(chunk.slot)
                pending.append(pool.submit(fill, chunk))
                while len(pending) > lookahead:
                    send(pending.popleft().result())
            while pending:
                send(pending.popleft().result())
        finally:
            for future in pending:  # an error: no fill may still be writing when the buffers are freed
                future.cancel()


# torch's dtypes by safetensors' names (helios.core.load's table, the other way round)
_SAFETENSORS_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32"}


def adopt_early(upload, tensors: Mapping[str, torch.Tensor], device: torch.device,
                dtypes: Mapping[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """The tensors of `tensors` that the early upload (helios.runner.early_upload.EarlyUpload, finished) holds on
    `device`, as torch tensors over its device memory (each keeps its bytes alive; cuMemFree when it is gone), those
    named in `dtypes` cast there (the uploaded bytes then freed). The upload's other tensors are freed."""
    out = {}
    try:
        for name, t in tensors.items():
            if not can_stage(t) or t.dtype not in _SAFETENSORS_NAMES:
                continue
            memory = upload.claim(name, _SAFETENSORS_NAMES[t.dtype], tuple(t.shape))
            if memory is None:
                continue
            d = torch.as_tensor(memory, device=device).view(t.dtype).view(t.shape)
            out[name] = d.to(dtypes[name]) if name in dtypes else d
    finally:
        upload.release()
    return out


def upload_tensors(tensors: Mapping[str, torch.Tensor], device: torch.device | str,
                   dtypes: Mapping[str, torch.dtype] | None = None, buffer_bytes: int = BUFFER_BYTES,
                   num_buffers: int = NUM_BUFFERS, num_threads: int = NUM_THREADS,
                   switch_interval_s: float | None = SWITCH_INTERVAL_S) -> dict[str, torch.Tensor]:
    """`tensors` on `device`, those named in `dtypes` cast there; through pinned staging buffers on CUDA (the
    copies finished when this returns; casts are queued on the current stream), move_each elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return move_each(tensors, device, dtypes or {})
    return copy_through(tensors, lambda size, count: CudaRing(device, size, count), dtypes, buffer_bytes,
                        num_buffers, num_threads, switch_interval_s)
