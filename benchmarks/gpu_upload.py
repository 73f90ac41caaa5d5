"""The weights upload of `helios serve` (issue 22): the plain `t.to(device, non_blocking=True)` loop against
helios.runner.upload's pinned ring (a few buffer sizes, buffer counts and filling threads), from an 8B-llama-shaped
safetensors file of random bf16 tensors mapped as helios.core.load maps a core (a fresh mapping per run, as at
start-up; the file page-cached by one read first). Each run starts with the previous run's device copies freed and
the allocator emptied; it prints seconds and GB/s, then the same run again beside a busy Python thread (as the kernel
load runs beside the upload): both times and how much of its alone rate that thread kept. A sample of tensors is
compared bitwise with the plain copy.
Usage: python benchmarks/gpu_upload.py [--layers 32] [--dir /tmp] [--configs 64:4:2,128:4:2,64:4:0,64:4:2:5]
       python benchmarks/gpu_upload.py --dry   (this CPU: a tiny file through HostRing, the plan's statistics)
A config is buffer MiB:buffers:filling threads[:the GIL switch interval in ms while the loop runs]. --layers 32
writes ~16 GB (that much free disk and page cache needed; estimated at about a minute on an H200 host with the
default configs, not yet timed there; --layers 16 halves the file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helios.core.load import _map_safetensors  # noqa: E402
from helios.runner.upload import (  # noqa: E402
    ALIGN, SWITCH_INTERVAL_S, HostRing, copy_through, plan_chunks, staged_bytes, upload_tensors)

LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_kv_heads=8, head_dim=128)
TINY = dict(vocab_size=1000, hidden_size=256, intermediate_size=704, num_kv_heads=2, head_dim=32)


def llama_shapes(dims: dict, num_layers: int) -> dict[str, list[int]]:
    """helios' tensor names and shapes of a llama core (fused qkv and gate_up), in file order."""
    h, i = dims["hidden_size"], dims["intermediate_size"]
    qkv = h + 2 * dims["num_kv_heads"] * dims["head_dim"]
    shapes = {"embed.weight": [dims["vocab_size"], h]}
    for n in range(num_layers):
        p = f"layers.{n}."
        shapes.update({p + "attn_norm.weight": [h], p + "attn.qkv.weight": [qkv, h], p + "attn.o.weight": [h, h],
                       p + "mlp_norm.weight": [h], p + "mlp.gate_up.weight": [2 * i, h], p + "mlp.down.weight": [h, i]})
    shapes.update({"norm.weight": [h], "lm_head.weight": [dims["vocab_size"], h]})
    return shapes


def write_safetensors(path: Path, shapes: dict[str, list[int]], block_elems: int) -> int:
    """A bf16 safetensors file of `shapes`: each tensor a window of one random block at its own offset (distinct
    bytes per tensor without generating gigabytes of randomness). Returns the data bytes."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 2 * torch.Size(shape).numel()
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    block = torch.randn(block_elems, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    block = torch.cat([block, block]).view(torch.uint8).numpy()  # windows wrap without a seam check
    size = block_elems * 2
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for k, name in enumerate(header):
            start, end = header[name]["data_offsets"]
            at, left = (k * 7919 * ALIGN) % size, end - start
            while left:
                n = min(left, size)
                f.write(memoryview(block[at:at + n]))
                left -= n
    return offset


def read_once(path: Path) -> float:
    buf = bytearray(64 << 20)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass
    return time.perf_counter() - t0


class GilProbe:
    """A Python thread counting loop turns while a run goes on (it stands for the kernel load beside the upload):
    its rate then over its rate alone."""

    def __init__(self):
        self.count, self.active, self.idle = 0, threading.Event(), 0.0

    def measure_idle(self, seconds: float = 0.2) -> None:
        self.idle = 0.0
        self.start()
        time.sleep(seconds)
        self.idle = self.stop()

    def _spin(self) -> None:
        while self.active.is_set():
            self.count += 1

    def start(self) -> None:
        self.count, self.t0 = 0, time.perf_counter()
        self.active.set()
        self.thread = threading.Thread(target=self._spin, daemon=True)
        self.thread.start()

    def stop(self) -> float:
        """The loop's rate since start, over its idle rate (after construction)."""
        self.active.clear()
        self.thread.join()
        rate = self.count / (time.perf_counter() - self.t0)
        return rate / self.idle if self.idle else rate


def plain(tensors: dict, device: str) -> dict:
    if device == "cpu":  # .to("cpu") would hand back the source itself
        return {n: t.clone() for n, t in tensors.items()}
    return {n: t.to(device, non_blocking=True) for n, t in tensors.items()}


def parse_configs(text: str) -> list[tuple[int, int, int, float]]:
    """MiB:buffers:threads[:switch interval ms] each, the interval helios.runner.upload's by default."""
    configs = []
    for c in text.split(","):
        m, b, th, *ms = c.split(":")
        configs.append((int(m), int(b), int(th), float(ms[0]) if ms else SWITCH_INTERVAL_S * 1e3))
    return configs


def ring_label(m: int, b: int, th: int, ms: float) -> str:
    return f"ring {m} MiB x {b}, {th} threads, {ms:g} ms"


def plan_stats(shapes: dict[str, list[int]], buffer_bytes: int, num_buffers: int) -> str:
    """The plan copy_through makes for a bf16 file of `shapes` (file order is address order)."""
    sizes = [2 * torch.Size(shape).numel() for shape in shapes.values()]
    buffer_bytes = min(buffer_bytes, staged_bytes(sizes))
    chunks = plan_chunks(sizes, buffer_bytes, num_buffers)
    used = sum(c.num_bytes for c in chunks)
    pieces = sum(len(c.pieces) for c in chunks)
    return f"{len(chunks)} chunks, {pieces} pieces, buffers {100 * used / (len(chunks) * buffer_bytes):.0f}% full"


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_runs(path: Path, total: int, runs: list, device: str) -> bool:
    """Each run alone (checked bitwise on a sample against the source), then beside a busy Python thread; one line
    per run. False if a sample differed."""
    probe, ok = GilProbe(), True
    for label, upload in runs:
        times, kept, same = [], 0.0, False
        for beside in (False, True):
            tensors = _map_safetensors(path)  # a fresh mapping: its page-table faults are part of a cold start
            sync(device)
            if beside:
                probe.measure_idle()
                probe.start()
            t0 = time.perf_counter()
            out = upload(tensors)
            sync(device)
            times.append(time.perf_counter() - t0)
            if beside:
                kept = probe.stop()
            else:
                names = list(tensors)
                sample = names[:3] + names[len(names) // 2:len(names) // 2 + 3] + names[-3:]
                same = all(out[n].device.type == device and torch.equal(
                    out[n].view(torch.int16), tensors[n].to(device).view(torch.int16)) for n in sample)
            del out, tensors
            if device == "cuda":
                torch.cuda.empty_cache()
        ok = ok and same
        print(f"{label:>42}: {times[0]:6.3f} s, {total / times[0] / 1e9:6.2f} GB/s, sample bitwise equal: {same} | "
              f"beside a busy Python thread {times[1]:6.3f} s, which kept {100 * kept:3.0f}% of its rate", flush=True)
    return ok


class FillOnlyRing(HostRing):
    """The host half alone: the buffers filled from the mapping, nothing sent (the targets on `meta`)."""

    def empty(self, t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="meta")

    def send(self, slot: int, copies: list) -> None:
        pass


def time_fills(path: Path, total: int, configs: list) -> None:
    """How fast the host fills buffers from a fresh mapping (page faults included), nothing sent: the ceiling of
    a ring whose copy engine were infinitely fast."""
    for m, b, th, ms in configs:
        tensors = _map_safetensors(path)
        t0 = time.perf_counter()
        copy_through(tensors, FillOnlyRing, buffer_bytes=m << 20, num_buffers=b, num_threads=th,
                     switch_interval_s=ms / 1e3)
        dt = time.perf_counter() - t0
        print(f"{'host fill alone, ' + ring_label(m, b, th, ms):>42}: {dt:6.3f} s, {total / dt / 1e9:6.2f} GB/s")


def memory_dir(num_bytes: int) -> str | None:
    """/dev/shm when it holds the file with room to spare (no disk writes; its mapped pages fault in as the page
    cache's do), else None: the temp dir."""
    try:
        stat = os.statvfs("/dev/shm")
    except OSError:
        return None
    return "/dev/shm" if stat.f_bavail * stat.f_frsize > 1.25 * num_bytes else None


def run_dry(args) -> bool:
    configs = parse_configs("1:2:0,1:3:1,4:4:2,4:4:2:5")
    shapes = llama_shapes(TINY, 2)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "tiny.safetensors"
        total = write_safetensors(path, shapes, block_elems=1 << 18)
        print(f"dry: {total / 2**20:.1f} MiB, CPU only: HostRing (deferred sends) stands in for the device; "
              f"{torch.get_num_threads()} intra-op threads")
        for m, b, *_ in configs[:3]:
            print(f"  plan at {m} MiB x {b}: {plan_stats(shapes, m << 20, b)}")
        for m, b in [(32, 4), (64, 4), (128, 4)]:
            print(f"  8B llama plan at {m} MiB x {b}: {plan_stats(llama_shapes(LLAMA_8B, 32), m << 20, b)}")
        runs = [("plain clone loop", lambda t: plain(t, "cpu"))]
        runs += [("host " + ring_label(*c),
                  lambda t, m=m, b=b, th=th, ms=ms: copy_through(t, HostRing, buffer_bytes=m << 20, num_buffers=b,
                                                                 num_threads=th, switch_interval_s=ms / 1e3))
                 for c in configs for m, b, th, ms in [c]]
        time_fills(path, total, configs[:3])
        return time_runs(path, total, runs, "cpu")


def run_gpu(args) -> bool:
    device = "cuda"
    torch.empty(1, device=device)
    configs = parse_configs(args.configs)
    shapes = llama_shapes(LLAMA_8B, args.layers)
    size = sum(2 * torch.Size(shape).numel() for shape in shapes.values())
    with tempfile.TemporaryDirectory(dir=args.dir or memory_dir(size)) as tmp:
        path = Path(tmp) / "llama.safetensors"
        t0 = time.perf_counter()
        total = write_safetensors(path, shapes, block_elems=64 << 20)
        print(f"wrote {total / 1e9:.2f} GB ({args.layers} layers) to {tmp} in {time.perf_counter() - t0:.1f} s; "
              f"read once in {read_once(path):.1f} s; {torch.cuda.get_device_name()}, "
              f"{os.cpu_count()} CPUs, torch {torch.get_num_threads()} intra-op threads")
        t0 = time.perf_counter()
        pinned = torch.empty(4 * (64 << 20), dtype=torch.uint8, pin_memory=True)
        print(f"pinned allocation of 256 MiB: {(time.perf_counter() - t0) * 1e3:.0f} ms")
        del pinned
        torch._C._host_emptyCache()
        for m, b in sorted({(m, b) for m, b, *_ in configs}):
            print(f"  plan at {m} MiB x {b}: {plan_stats(shapes, m << 20, b)}")
        runs = [("plain t.to loop", lambda t: plain(t, device))]
        runs += [(ring_label(*c),
                  lambda t, m=m, b=b, th=th, ms=ms: upload_tensors(t, device, buffer_bytes=m << 20, num_buffers=b,
                                                                   num_threads=th, switch_interval_s=ms / 1e3))
                 for c in configs for m, b, th, ms in [c]]
        time_fills(path, total, parse_configs("64:4:0,64:4:1,64:4:2"))
        return time_runs(path, total, runs, device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry", action="store_true", help="this CPU: a tiny file through HostRing, no CUDA")
    ap.add_argument("--layers", type=int, default=32, help="llama-8B layers in the file (32: ~16 GB)")
    ap.add_argument("--dir", default=None, help="where the file is written (default: /dev/shm if it has room, "
                                                "else the temp dir)")
    ap.add_argument("--configs", default="64:4:2,128:4:2,32:4:2,16:4:2,64:4:1,64:4:0,64:4:2:5",
                    help="ring variants, buffer MiB:buffers:threads[:GIL switch interval ms], comma-separated")
    args = ap.parse_args()
    t0 = time.perf_counter()
    ok = run_dry(args) if args.dry else run_gpu(args)
    print(f"benchmark: {time.perf_counter() - t0:.1f} s")
    if not ok:
        raise SystemExit("a copy differed from its source")


if __name__ == "__main__":
    main()
