"""The weights' upload beside torch's import (helios.runner.early_upload), each variant in a fresh process as
`helios serve` starts: the upload started, then `import torch`, CUDA's start, the wait for the upload and torch's
adoption of its bytes; against today's order (torch imported, then the pinned ring of helios.runner.upload) and
the upload alone (no import beside). Prints seconds from the process's first line to each point.

  python benchmarks/gpu_early_upload.py --core /tmp/serve/core-8b [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
sys.path.insert(0, {root!r})
from pathlib import Path
core, variant = Path({core!r}), {variant!r}
marks = {{}}
up = None
if variant["mode"] != "off":
    from helios.runner import early_upload
    up = early_upload.start(core, 0, mode=variant["mode"], num_threads=variant["threads"],
                            buffer_bytes=variant["buffer_mb"] << 20, fill=variant.get("fill", "read"))
    if variant.get("alone"):
        up.wait()
        marks["upload_alone"] = time.perf_counter() - t0
interval = sys.getswitchinterval()
sys.setswitchinterval(variant.get("interval", 0.0005))
import torch
sys.setswitchinterval(interval)
marks["torch_imported"] = time.perf_counter() - t0
torch.zeros(1, device="cuda")
marks["cuda_ready"] = time.perf_counter() - t0
from helios.core.load import load_core
from helios.runner.upload import adopt_early, upload_tensors
tensors = load_core(core, verify_digests=False).tensors
if up is not None:
    ok = up.wait()
    marks["upload_waited"] = time.perf_counter() - t0
    marks["upload_s"] = up.seconds
    assert ok, up.error
    out = adopt_early(up, tensors, torch.device("cuda"), {{}})
else:
    out = upload_tensors(tensors, "cuda")
torch.cuda.synchronize()
marks["weights_ready"] = time.perf_counter() - t0
assert len(out) == len(tensors)
name = max(tensors, key=lambda n: tensors[n].numel())
assert torch.equal(out[name][-1].cpu(), tensors[name][-1]), "bytes differ"
marks["bytes"] = sum(t.numel() * t.element_size() for t in tensors.values())
print("MARKS " + json.dumps(marks))
"""

VARIANTS = {
    "today: import, then the torch ring": dict(mode="off"),
    "pinned 8 threads 64 MB": dict(mode="pinned", threads=8, buffer_mb=64),
    "pinned 8 threads 64 MB, memmove fills": dict(mode="pinned", threads=8, buffer_mb=64, fill="map"),
    "pinned 8 threads 64 MB, interval 0.1 ms": dict(mode="pinned", threads=8, buffer_mb=64, interval=0.0001),
    "pinned 8 threads 128 MB": dict(mode="pinned", threads=8, buffer_mb=128),
    "pinned 4 threads 128 MB": dict(mode="pinned", threads=4, buffer_mb=128),
    "pinned 16 threads 32 MB": dict(mode="pinned", threads=16, buffer_mb=32),
    "pageable 8 threads 64 MB": dict(mode="pageable", threads=8, buffer_mb=64),
    "pinned 8 threads 64 MB, alone first": dict(mode="pinned", threads=8, buffer_mb=64, alone=True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=Path, required=True)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--variants", default="", help="comma-separated substrings of the variants to run (all: empty)")
    args = ap.parse_args()
    wanted = [w for w in args.variants.split(",") if w]
    print(f"{'variant':44s} {'import':>7s} {'cuda':>6s} {'waited':>7s} {'upload':>7s} {'ready':>6s}  GB/s")
    for name, variant in VARIANTS.items():
        if wanted and not any(w in name for w in wanted):
            continue
        for _ in range(args.repeat):
            code = CHILD.format(root=str(ROOT), core=str(args.core.resolve()), variant=variant)
            run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
            line = next((x for x in run.stdout.splitlines() if x.startswith("MARKS ")), None)
            if line is None:
                print(f"{name:44s} failed: {(run.stderr or run.stdout).strip().splitlines()[-1:]}")
                continue
            m = json.loads(line[6:])
            upload = m.get("upload_s", m["weights_ready"] - m["cuda_ready"])
            print(f"{name:44s} {m['torch_imported']:7.2f} {m['cuda_ready']:6.2f} {m.get('upload_waited', 0):7.2f} "
                  f"{upload:7.2f} {m['weights_ready']:6.2f}  {m['bytes'] / upload / 1e9:5.1f}"
                  + (f"  (alone {m['upload_alone']:.2f})" if "upload_alone" in m else ""), flush=True)


if __name__ == "__main__":
    main()
