"""The weights' upload started before torch is imported: the CUDA driver API through ctypes, on threads beside
`import torch` (2.7-4.9 s on the lent hosts, session 24), so a GPU server's restart does not wait for the copies.

`EarlyUpload.start` reads the safetensors headers of the core's weight files, allocates each tensor's device memory
(one cuMemAlloc a tensor, so each can be freed alone: the norm fold replaces some at load), and copies the bytes,
each file front to back, by one of two paths:
  pinned    a few threads, each with two pinned staging buffers (cuMemHostAlloc), a stream and an event per
            buffer, fill a buffer (os.preadv from the file, or memmove from a mapping of it) and send it
            (cuMemcpyHtoDAsync); the chunks are helios.runner.upload_plan's, as for the torch ring
            (helios.runner.upload), handed to the threads in turn;
  pageable  one cuMemcpyHtoDAsync per piece straight from a mapping (the driver stages it), on a few threads.
Every driver call, read and memmove releases the GIL (ctypes, os), so the threads need the interpreter only between
calls. The device memory is the primary context's, which torch's runtime adopts when it starts; `DeviceBytes` shows a
tensor's bytes through __cuda_array_interface__ (helios.runner.upload.adopt_early wraps them) and frees them with
cuMemFree when the last tensor over them is gone; `release` frees what nobody claimed.
Any failure (no driver, no memory, an unreadable file) leaves nothing behind: the load then takes the torch path as
if no early upload had run.
Standard library only (never torch): helios.compose starts it before torch is imported.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from helios.core import layout
from helios.runner.upload_plan import Chunk, plan_chunks, staged_bytes

MODES = ("pinned", "pageable")
# how the pinned path fills a buffer: read (os.preadv from the file: the page cache's bytes, no page faults) or map
# (memmove from a mapping of the file)
FILLS = ("read", "map")
BUFFER_BYTES = 64 << 20  # a pinned buffer; a pageable copy's largest piece
NUM_THREADS = 8  # copy threads
_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy default stream (torch's)
_NO_TIMING = 2  # CU_EVENT_DISABLE_TIMING


class DriverError(RuntimeError):
    """A driver call failed; the message names the call and the driver's error."""


class Driver:
    """The few CUDA driver entry points the upload calls, from libcuda.so.1; each raises DriverError on failure."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        u64, vp, c_uint, c_int, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int, ctypes.c_size_t
        self._fns = {}
        for name, args in (
            ("cuInit", [c_uint]),
            ("cuDeviceGet", [ctypes.POINTER(c_int), c_int]),
            ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(vp), c_int]),
            ("cuCtxSetCurrent", [vp]),
            ("cuMemAlloc", [ctypes.POINTER(u64), size]),
            ("cuMemFree", [u64]),
            ("cuMemHostAlloc", [ctypes.POINTER(vp), size, c_uint]),
            ("cuMemFreeHost", [vp]),
            ("cuMemcpyHtoDAsync", [u64, vp, size, vp]),
            ("cuStreamCreate", [ctypes.POINTER(vp), c_uint]),
            ("cuStreamSynchronize", [vp]),
            ("cuStreamDestroy", [vp]),
            ("cuEventCreate", [ctypes.POINTER(vp), c_uint]),
            ("cuEventRecord", [vp, vp]),
            ("cuEventSynchronize", [vp]),
            ("cuEventDestroy", [vp]),
            ("cuGetErrorName", [c_int, ctypes.POINTER(ctypes.c_char_p)]),
        ):
            fn = None
            for symbol in (name + "_v2", name):  # the versioned entry point where the header maps the name to one
                fn = getattr(self.lib, symbol, None)
                if fn is not None:
                    break
            if fn is None:
                raise DriverError(f"libcuda.so.1 has no {name}")
            fn.argtypes, fn.restype = args, c_int
            self._fns[name] = fn

    def __call__(self, name: str, *args) -> None:
        result = self._fns[name](*args)
        if result != 0:
            text = ctypes.c_char_p()
            self._fns["cuGetErrorName"](result, ctypes.byref(text))
            raise DriverError(f"{name}: {(text.value or b'?').decode()} ({result})")

    def context(self, ordinal: int) -> ctypes.c_void_p:
        """The device's primary context (torch's runtime uses the same one), current on this thread."""
        self("cuInit", 0)
        device, ctx = ctypes.c_int(), ctypes.c_void_p()
        self("cuDeviceGet", ctypes.byref(device), ordinal)
        self("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), device)
        self("cuCtxSetCurrent", ctx)
        return ctx


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a weights file: its safetensors dtype and shape, and where its bytes are in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: int
    offset: int
    num_bytes: int


def read_entries(files: list[Path]) -> list[Entry]:
    """Every non-empty tensor of the safetensors `files` but the MTP draft modules' (the runner leaves them mapped),
    in file order and, within a file, by offset.
    NOTE: a family's host row tables (helios.runner.host_embedding: gemma4's PLE) are uploaded too, then freed
    unclaimed: the upload cannot tell them without the model's rules (torch's side)."""
    entries = []
    for index, file in enumerate(files):
        with open(file, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len))
        base = 8 + header_len
        found = []
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            if end > start and not name.startswith(layout.MTP_PREFIX):  # the draft modules stay on the host
                found.append(Entry(name, info["dtype"], tuple(info["shape"]), index, base + start, end - start))
        entries.extend(sorted(found, key=lambda e: e.offset))
    return entries


class DeviceBytes:
    """One tensor's device memory, shown to torch as flat uint8 bytes; cuMemFree once nothing refers to it."""

    def __init__(self, driver: Driver, ptr: int, num_bytes: int):
        self.driver, self.ptr, self.num_bytes = driver, ptr, num_bytes

    @property
    def __cuda_array_interface__(self) -> dict:
        # NOTE: no stream: the upload synchronized its streams before anyone could claim these bytes
        return {"shape": (self.num_bytes,), "typestr": "|u1", "data": (self.ptr, False), "version": 3,
                "strides": None}

    def free(self) -> None:
        ptr, self.ptr = self.ptr, 0
        if ptr:
            try:
                self.driver("cuMemFree", ptr)
            except Exception:  # noqa: BLE001 - at interpreter exit the context (and ctypes) may be gone first
                pass

    def __del__(self) -> None:
        self.free()


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a tensor's bytes are: a file descriptor and the offset in its file, or (fd None) a host address."""

    fd: int | None
    at: int

    def copy_to(self, address: int, start: int, num_bytes: int) -> None:
        """Bytes [start, start + num_bytes) of the tensor to host memory at `address` (one call: the GIL is free)."""
        if self.fd is None:
            ctypes.memmove(address, self.at + start, num_bytes)
            return
        view = memoryview((ctypes.c_char * num_bytes).from_address(address)).cast("B")
        done = 0
        while done < num_bytes:
            got = os.preadv(self.fd, [view[done:]], self.at + start + done)
            if got <= 0:
                raise OSError(f"short read: {done + max(got, 0)} of {num_bytes} bytes")
            done += got


class EarlyUpload:
    """The upload of one core's weights to CUDA device `ordinal`, on a thread started by `start`."""

    def __init__(self, core_path: Path, ordinal: int = 0, mode: str = "pinned", num_threads: int = NUM_THREADS,
                 buffer_bytes: int = BUFFER_BYTES, fill: str = "read",
                 driver_factory: Callable[[], Driver] | None = None):
        if mode not in MODES or fill not in FILLS:
            raise ValueError(f"mode {mode!r}, fill {fill!r}: one of {MODES}, one of {FILLS}")
        self.fill = fill
        self.core_path, self.ordinal, self.mode = Path(core_path).resolve(), ordinal, mode
        self.num_threads, self.buffer_bytes = max(1, num_threads), buffer_bytes
        self.memory: dict[str, tuple[Entry, DeviceBytes]] = {}
        self.error: BaseException | None = None
        self.seconds = 0.0  # start to the last copy's end
        self.num_bytes = 0
        self._thread: threading.Thread | None = None
        self._driver_factory = driver_factory or Driver  # tests: a stand-in that copies within host memory

    def start(self) -> EarlyUpload:
        self._thread = threading.Thread(target=self._run, name="helios-early-upload", daemon=True)
        self._thread.start()
        return self

    def wait(self) -> bool:
        """Whether every tensor is on the device (False: the upload failed and freed what it held; see .error)."""
        if self._thread is not None:
            self._thread.join()
        return self.error is None

    def claim(self, name: str, dtype: str, shape: tuple[int, ...]) -> DeviceBytes | None:
        """The device bytes of tensor `name` when it was uploaded with this dtype (safetensors' name) and shape,
        handed over once (the caller's tensor keeps them alive); None otherwise."""
        found = self.memory.get(name)
        if found is None or found[0].dtype != dtype or found[0].shape != tuple(shape):
            return None
        del self.memory[name]
        return found[1]

    def release(self) -> None:
        """Free what nobody claimed."""
        memory, self.memory = self.memory, {}
        for _, mem in memory.values():
            mem.free()

    # --- the thread ------------------------------------------------------------------------------------------

    def _run(self) -> None:
        t0 = time.perf_counter()
        fds: list[int] = []
        maps: list[mmap.mmap] = []
        try:
            driver = self._driver_factory()
            ctx = driver.context(self.ordinal)
            files = sorted((self.core_path / layout.WEIGHTS_DIR).glob("*.safetensors"))
            entries = read_entries(files)
            for e in entries:
                ptr = ctypes.c_uint64()
                driver("cuMemAlloc", ctypes.byref(ptr), e.num_bytes)
                self.memory[e.name] = (e, DeviceBytes(driver, ptr.value, e.num_bytes))
            fds = [os.open(file, os.O_RDONLY) for file in files]
            if self.mode == "pageable" or self.fill == "map":
                # MAP_PRIVATE + PROT_WRITE: ctypes wants a writable buffer for an address; nothing writes it
                maps = [mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE) for fd in fds]
                bases = [ctypes.addressof(ctypes.c_char.from_buffer(m)) for m in maps]
                sources = [_Source(None, bases[e.file] + e.offset) for e in entries]
            else:
                sources = [_Source(fds[e.file], e.offset) for e in entries]
            targets = [self.memory[e.name][1].ptr for e in entries]
            sizes = [e.num_bytes for e in entries]
            if self.mode == "pinned":
                self._pinned(driver, ctx, sources, targets, sizes)
            else:
                self._pageable(driver, ctx, [src.at for src in sources], targets, sizes)
            self.num_bytes = sum(sizes)
        except BaseException as e:  # noqa: BLE001 - reported by wait(); the load goes on without us
            self.error = e
            self.release()
        finally:
            for m in maps:  # NOTE: the c_char views that gave the addresses are gone: nothing holds an export
                m.close()
            for fd in fds:
                os.close(fd)
            self.seconds = time.perf_counter() - t0

    def _pinned(self, driver: Driver, ctx, sources: list[_Source], targets: list[int], sizes: list[int]) -> None:
        """Each thread its own pipeline: two pinned buffers, a stream and an event each; it fills a buffer
        once that buffer's last copy is done, then queues the buffer's copy. The plan's chunks (small tensors
        packed, large ones cut to buffer_bytes) go to the threads in turn.
        NOTE: a chunk costs the interpreter four calls or so (wait, fill, copy, record): beside `import torch`,
        which holds the interpreter all the time, every call waits for its turn (the switch interval), so the
        fewer calls a byte takes, the faster the upload (a shared ring, a pool's futures per fill, ran at 3-4 GB/s
        there against 12.7 alone, session 25)."""
        buffer_bytes = min(self.buffer_bytes, staged_bytes(sizes))
        chunks = plan_chunks(sizes, buffer_bytes, 1)
        threads = max(1, min(self.num_threads, len(chunks)))
        host = ctypes.c_void_p()
        driver("cuMemHostAlloc", ctypes.byref(host), threads * 2 * buffer_bytes, 0)
        try:
            with ThreadPoolExecutor(threads, thread_name_prefix="helios-early-copy") as pool:
                futures = [pool.submit(self._pipeline, driver, ctx, chunks[k::threads],
                                       host.value + 2 * k * buffer_bytes, buffer_bytes, sources, targets)
                           for k in range(threads)]
                for future in futures:
                    future.result()
        finally:
            driver("cuMemFreeHost", host)

    @staticmethod
    def _pipeline(driver: Driver, ctx, chunks: list[Chunk], buffers: int, buffer_bytes: int,
                  sources: list[_Source], targets: list[int]) -> None:
        driver("cuCtxSetCurrent", ctx)
        stream = ctypes.c_void_p()
        events = [ctypes.c_void_p(), ctypes.c_void_p()]
        driver("cuStreamCreate", ctypes.byref(stream), _NON_BLOCKING)
        try:
            for event in events:
                driver("cuEventCreate", ctypes.byref(event), _NO_TIMING)
            for j, chunk in enumerate(chunks):
                buffer = buffers + (j % 2) * buffer_bytes
                if j >= 2:
                    driver("cuEventSynchronize", events[j % 2])  # this buffer's last copy is done
                for p in chunk.pieces:
                    sources[p.index].copy_to(buffer + p.offset, p.start, p.num_bytes)
                for p in chunk.pieces:
                    driver("cuMemcpyHtoDAsync", targets[p.index] + p.start, buffer + p.offset, p.num_bytes, stream)
                driver("cuEventRecord", events[j % 2], stream)
        finally:
            if stream.value:
                driver("cuStreamSynchronize", stream)  # no buffer is freed under a copy still reading it
            for event in events:
                if event.value:
                    driver("cuEventDestroy", event)
            if stream.value:
                driver("cuStreamDestroy", stream)

    def _pageable(self, driver: Driver, ctx, sources: list[int], targets: list[int], sizes: list[int]) -> None:
        pieces = [(targets[i] + start, sources[i] + start, min(self.buffer_bytes, size - start))
                  for i, size in enumerate(sizes) for start in range(0, size, self.buffer_bytes)]
        lock = threading.Lock()
        cursor = iter(pieces)

        def copy_all() -> None:
            driver("cuCtxSetCurrent", ctx)
            stream = ctypes.c_void_p()
            driver("cuStreamCreate", ctypes.byref(stream), _NON_BLOCKING)
            try:
                while True:
                    with lock:
                        piece = next(cursor, None)
                    if piece is None:
                        break
                    driver("cuMemcpyHtoDAsync", piece[0], piece[1], piece[2], stream)
                driver("cuStreamSynchronize", stream)
            finally:
                driver("cuStreamDestroy", stream)

        with ThreadPoolExecutor(self.num_threads, thread_name_prefix="helios-early-copy") as pool:
            for future in [pool.submit(copy_all) for _ in range(self.num_threads)]:
                future.result()


def device_ordinal(device: str) -> int | None:
    """The CUDA ordinal of a server's device setting ("cuda", "cuda:N", "auto" on a GPU machine), None for others."""
    if device in ("cuda", "auto"):
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


_current: EarlyUpload | None = None


def start(core_path: Path, ordinal: int, **kwargs) -> EarlyUpload:
    """Start the process's early upload (helios.compose, before torch's import); `take` hands it to the runner."""
    global _current
    _current = EarlyUpload(core_path, ordinal, **kwargs).start()
    return _current


def take(core_path: Path | None, ordinal: int) -> EarlyUpload | None:
    """The early upload started for this core and device, finished, once; None when there is none, or it failed (its
    memory freed), or it is another's (freed too)."""
    global _current
    upload, _current = _current, None
    if upload is None:
        return None
    ok = upload.wait()
    if not ok or core_path is None or Path(core_path).resolve() != upload.core_path or ordinal != upload.ordinal:
        upload.release()
        return None
    return upload

