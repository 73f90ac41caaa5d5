"""A core's weights to the GPU as `helios serve` maps and uploads them (issue 22's cold start), each way alone in a
fresh mapping: the driver-staged copies, the pinned ring (helios.runner.upload) at torch's intra-op threads and at
one, and the ring from mappings whose page tables the kernel filled at mmap time (MAP_POPULATE: no page faults in
the copy loop). Prints seconds and GB/s of each, and how long the mapping took (populated: a thread beside torch's
import could make it).
Usage: python benchmarks/gpu_core_upload.py --core /tmp/serve/core-8b [--repeat 2]
"""

from __future__ import annotations

import argparse
import mmap
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from helios.core import layout  # noqa: E402
from helios.core.load import _map_safetensors  # noqa: E402
from helios.runner.upload import upload_tensors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    files = sorted((args.core / layout.WEIGHTS_DIR).glob("*.safetensors"))
    total = sum(f.stat().st_size for f in files)
    torch.zeros(1, device="cuda")
    threads = torch.get_num_threads()  # NOTE: a GPU server ran its load at one thread until session 24
    print(f"{args.core}: {len(files)} files, {total / 1e9:.2f} GB; {torch.cuda.get_device_name()}", flush=True)

    def mapped(flags: int = 0) -> dict:
        out = {}
        for file in files:
            out.update(_map_safetensors(file, flags))
        return out

    for _ in range(args.repeat):
        for label in ("plain t.to loop", "pinned ring", "pinned ring, one intra-op thread",
                      "pinned ring, populated mappings"):
            torch.set_num_threads(1 if label.endswith("one intra-op thread") else threads)
            extra, t0 = "", time.perf_counter()
            tensors = mapped(mmap.MAP_POPULATE if label.endswith("populated mappings") else 0)
            extra = f" (mapping took {time.perf_counter() - t0:.2f} s before it)"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            if label == "plain t.to loop":
                out = {n: t.to("cuda", non_blocking=True) for n, t in tensors.items()}
            else:
                out = upload_tensors(tensors, "cuda")
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            print(f"{label:>32}: {dt:6.3f} s, {total / dt / 1e9:6.2f} GB/s{extra}", flush=True)
            del out, tensors
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
