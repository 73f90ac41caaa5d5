"""Where a GPU server's kernel load goes (issue 22's cold start): helios.kernels.aot.load_kernels on a core's
precompiled kernels in a fresh process, as `helios serve` runs it after torch's import, under cProfile; with and
without helios.kernels.triton_warmup run first (the thread compose starts beside torch's import). Prints the
load's phases (install, hook, compile, launchers) and the profile's heaviest calls.
Usage: python benchmarks/gpu_kernel_load.py --core /tmp/serve/core-8b [--top 35]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import cProfile, io, pstats, sys, time
from pathlib import Path
core_path, cache, warm, top = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
t0 = time.perf_counter()
if warm:
    from helios.kernels import triton_warmup
    thread = triton_warmup.start()
import torch
t1 = time.perf_counter()
torch.zeros(1, device="cuda")
t2 = time.perf_counter()
if warm:
    thread.join()
t3 = time.perf_counter()
from helios.core.load import load_core
from helios.kernels.aot import load_kernels
core = load_core(core_path, verify_digests=False, map_weights=False)
profile = cProfile.Profile()
t4 = time.perf_counter()
profile.enable()
load = load_kernels(core_path, core.manifest.kernels, "cuda", core.manifest, cache_root=cache)
profile.disable()
t5 = time.perf_counter()
print(f"warm-up {'on' if warm else 'off'}: torch import {t1 - t0:.2f} s, CUDA init {t2 - t1:.2f} s, warm-up wait "
      f"after them {t3 - t2:.2f} s, kernel load {t5 - t4:.2f} s: {load.summary()}", flush=True)
out = io.StringIO()
stats = pstats.Stats(profile, stream=out)
stats.sort_stats("cumulative").print_stats(top)
stats.sort_stats("tottime").print_stats(top // 2)
print(out.getvalue())
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--core", type=Path, required=True, help="a core exported with GPU kernels (--target cuda-smNN)")
    ap.add_argument("--top", type=int, default=35, help="profile rows")
    args = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        for warm in ("1", "0", "1"):  # the first installs the kernels; the other two find them, as restarts do
            proc = subprocess.run([sys.executable, "-c", CHILD, str(args.core), str(Path(tmp) / "cache"), warm,
                                   str(args.top)], env=env, capture_output=True, text=True, timeout=300)
            print(proc.stdout[-12000:] or proc.stderr[-4000:], flush=True)


if __name__ == "__main__":
    main()
