"""helios.runner.early_upload on the CPU: the driver stand-in below keeps "device" memory in host buffers and runs a
stream's copies only when an event or the stream is waited for (as a copy engine may lag), so a ring that refilled a
buffer before its copy was done would send the wrong bytes. The real driver runs in tests/gpu/test_early_upload_cuda.py.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from helios.core import layout
from helios.runner import early_upload
from helios.runner.early_upload import DeviceBytes, EarlyUpload, device_ordinal, read_entries

ROOT = Path(__file__).resolve().parents[2]


class FakeDriver:
    """The Driver's calls over host memory: allocations are ctypes buffers, copies queue per stream."""

    def __init__(self, fail_alloc_at: int | None = None):
        self.memory: dict[int, ctypes.Array] = {}
        self.queues: dict[int, list] = {}
        self.lock = threading.Lock()
        self.allocs = 0
        self.fail_alloc_at = fail_alloc_at
        self.handles = 0

    def context(self, ordinal: int):
        return ctypes.c_void_p(1)

    def _handle(self) -> int:
        self.handles += 1
        return 0x1000 + self.handles

    def _alloc(self, n: int) -> int:
        buf = ctypes.create_string_buffer(max(1, n))
        addr = ctypes.addressof(buf)
        self.memory[addr] = buf
        return addr

    def _run(self, stream: int, upto=None) -> None:
        queue = self.queues.setdefault(stream, [])
        while queue:
            item = queue.pop(0)
            if item[0] == "event":
                if item[1] is upto:
                    return
                continue
            _, dst, src, n = item
            ctypes.memmove(dst, src, n)

    def __call__(self, name: str, *args) -> None:
        with self.lock:
            if name == "cuMemAlloc":
                self.allocs += 1
                if self.allocs == self.fail_alloc_at:
                    raise early_upload.DriverError("cuMemAlloc: CUDA_ERROR_OUT_OF_MEMORY (2)")
                args[0]._obj.value = self._alloc(args[1])
            elif name == "cuMemHostAlloc":
                args[0]._obj.value = self._alloc(args[1])
            elif name in ("cuMemFree", "cuMemFreeHost"):
                addr = args[0].value if isinstance(args[0], ctypes.c_void_p) else args[0]
                del self.memory[addr]
            elif name in ("cuStreamCreate", "cuEventCreate"):
                args[0]._obj.value = self._handle()
            elif name == "cuMemcpyHtoDAsync":
                dst, src, n, stream = args
                self.queues.setdefault(stream.value, []).append(("copy", dst, src, n))
            elif name == "cuEventRecord":
                event, stream = args
                self.queues.setdefault(stream.value, []).append(("event", event))
            elif name == "cuEventSynchronize":
                event = args[0]
                for stream, queue in self.queues.items():
                    if any(item[0] == "event" and item[1] is event for item in queue):
                        self._run(stream, upto=event)
            elif name == "cuStreamSynchronize":
                self._run(args[0].value)
            elif name in ("cuCtxSetCurrent", "cuStreamDestroy", "cuEventDestroy"):
                pass
            else:
                raise AssertionError(f"unexpected driver call {name}")

    def read(self, ptr: int, n: int) -> bytes:
        return ctypes.string_at(ptr, n)


def write_core(root: Path) -> dict[str, torch.Tensor]:
    """Two weight files of mixed dtypes and sizes (one larger than the tests' buffers, one empty tensor)."""
    g = torch.Generator().manual_seed(0)
    first = {"a": torch.randn(300, 7, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g),
             "big": torch.randn(40, 129, generator=g).to(torch.float16), "empty": torch.zeros(0, 3)}
    second = {"c": torch.arange(33, dtype=torch.int32), "d": torch.randn(2, 3, generator=g).to(torch.bfloat16)}
    weights = root / layout.WEIGHTS_DIR
    weights.mkdir(parents=True)
    save_file(first, str(weights / "model-00001.safetensors"))
    save_file(second, str(weights / "model-00002.safetensors"))
    return {**first, **second}


def device_bytes(driver: FakeDriver, mem: DeviceBytes) -> bytes:
    return driver.read(mem.ptr, mem.num_bytes)


def tensor_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_read_entries_lists_every_nonempty_tensor_by_file_and_offset(tmp_path):
    tensors = write_core(tmp_path)
    files = sorted((tmp_path / layout.WEIGHTS_DIR).glob("*.safetensors"))
    entries = read_entries(files)
    assert {e.name for e in entries} == {n for n, t in tensors.items() if t.numel()}
    assert [e.file for e in entries] == sorted(e.file for e in entries)
    for e in entries:
        assert e.num_bytes == tensors[e.name].numel() * tensors[e.name].element_size()
        assert e.shape == tuple(tensors[e.name].shape)
        assert Path(files[e.file]).read_bytes()[e.offset:e.offset + e.num_bytes] == tensor_bytes(tensors[e.name])


@pytest.mark.parametrize("mode, fill", [("pinned", "read"), ("pinned", "map"), ("pageable", "map")])
@pytest.mark.parametrize("buffer_bytes, threads", [(512, 1), (1024, 3), (1 << 20, 8)])
def test_every_tensor_arrives_with_its_bytes(tmp_path, mode, fill, buffer_bytes, threads):
    """Small buffers: tensors cut into many chunks, each thread's two buffers refilled many times."""
    tensors = write_core(tmp_path)
    driver = FakeDriver()
    upload = EarlyUpload(tmp_path, 0, mode, threads, buffer_bytes, fill, driver_factory=lambda: driver).start()
    assert upload.wait(), upload.error
    assert upload.num_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for name, t in tensors.items():
        if t.numel() == 0:
            assert upload.claim(name, "F32", tuple(t.shape)) is None
            continue
        dtype = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.int32: "I32"}[t.dtype]
        assert upload.claim(name, "F32" if dtype != "F32" else "BF16", tuple(t.shape)) is None  # another dtype
        assert upload.claim(name, dtype, (t.numel() + 1,)) is None  # another shape
        mem = upload.claim(name, dtype, tuple(t.shape))
        assert device_bytes(driver, mem) == tensor_bytes(t), name
        assert upload.claim(name, dtype, tuple(t.shape)) is None  # handed over once
        mem.free()
    # the ring's pinned buffers are freed; what remains is nothing (every tensor claimed and freed)
    assert driver.memory == {}


def test_the_draft_modules_stay_on_the_host(tmp_path):
    """The MTP draft modules' tensors (layout.MTP_PREFIX) stay mapped on the host (the runner binds none yet)."""
    weights = tmp_path / layout.WEIGHTS_DIR
    weights.mkdir(parents=True)
    save_file({"a": torch.ones(4), f"{layout.MTP_PREFIX}0.eh_proj.weight": torch.ones(8, 4)},
              str(weights / "model.safetensors"))
    entries = read_entries([weights / "model.safetensors"])
    assert [e.name for e in entries] == ["a"]


def test_release_frees_what_nobody_claimed(tmp_path):
    write_core(tmp_path)
    driver = FakeDriver()
    upload = EarlyUpload(tmp_path, 0, "pinned", 2, 1024, driver_factory=lambda: driver).start()
    assert upload.wait()
    kept = upload.claim("a", "BF16", (300, 7))
    upload.release()
    assert set(driver.memory) == {kept.ptr}
    del kept  # the last reference: cuMemFree
    assert driver.memory == {}


def test_a_failed_allocation_leaves_nothing_behind(tmp_path):
    write_core(tmp_path)
    driver = FakeDriver(fail_alloc_at=3)
    upload = EarlyUpload(tmp_path, 0, "pinned", 2, 1024, driver_factory=lambda: driver).start()
    assert not upload.wait()
    assert "OUT_OF_MEMORY" in str(upload.error)
    assert driver.memory == {} and upload.memory == {}


def test_a_missing_driver_is_an_error_not_a_crash(tmp_path):
    write_core(tmp_path)

    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")

    upload = EarlyUpload(tmp_path, 0, driver_factory=no_driver).start()
    assert not upload.wait() and isinstance(upload.error, OSError)


def test_take_hands_the_upload_over_once_and_frees_another_cores(tmp_path, monkeypatch):
    write_core(tmp_path / "core")
    drivers = []

    def factory():
        drivers.append(FakeDriver())
        return drivers[-1]

    monkeypatch.setattr(early_upload, "_current", None)
    monkeypatch.setattr(early_upload, "Driver", factory)
    early_upload.start(tmp_path / "core", 0, mode="pageable")
    upload = early_upload.take(tmp_path / "core", 0)
    assert upload is not None and upload.wait() and upload.memory
    assert early_upload.take(tmp_path / "core", 0) is None  # once
    upload.release()
    for other in ((tmp_path / "other", 0), (tmp_path / "core", 1), (None, 0)):
        early_upload.start(tmp_path / "core", 0)
        assert early_upload.take(*other) is None
        assert drivers[-1].memory == {}  # freed, not leaked


def test_device_ordinal():
    assert device_ordinal("cuda") == 0 and device_ordinal("auto") == 0 and device_ordinal("cuda:3") == 3
    assert device_ordinal("cpu") is None and device_ordinal("cuda:x") is None


def test_module_imports_no_torch():
    """helios.compose starts the upload before torch is imported: importing it must not import torch."""
    code = "import sys, helios.runner.early_upload; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
