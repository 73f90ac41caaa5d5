"""Triton's first-use costs in a process, paid on a thread beside `import torch` when a GPU server starts.

The first compile or cache lookup of a process computes `triton.runtime.cache.triton_key()`, a sha256 of Triton's
sources and of libtriton.so (~500 MB: 0.42 s on the H100's host), and the CUDA backend's hash asks ptxas for its
version (a subprocess); the first launch imports triton.experimental.gluon (0.17 s there); the kernel load installs
the core's kernels into the runtime cache (0.27 s: helios.kernels.aot_install). helios.kernels.aot's kernel load did
all of it after torch's import, beside the weights' upload, whose ring needs the GIL between its copies; on a thread
started before torch's import (hashing, file copies and reads release the GIL) they cost the start little.
Nothing here changes what Triton computes: the values are Triton's own functions' results, cached where Triton
caches them, and the install is the one the kernel load repeats (finding every file in place).
Imports triton and helios.kernels.aot_install only, inside the thread (never torch): helios.compose starts it before
torch is imported.
"""

from __future__ import annotations

import importlib
import threading
from pathlib import Path


def _warm(kernels_dir: Path | None, cache_root: Path | None) -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no triton: the kernel load says so itself
        return
    if kernels_dir is not None:
        from helios.kernels.aot_install import INDEX_FILE, install_cache

        if (kernels_dir / INDEX_FILE).is_file():
            install_cache(kernels_dir, cache_root, activate=False)  # the kernel load points Triton at it
    triton_key()
    # NOTE: Triton 3.x's layout; another skips what it lacks
    try:
        from triton.backends.nvidia.compiler import get_ptxas_version
    except ImportError:
        pass
    else:
        try:
            get_ptxas_version()
        except Exception:  # noqa: BLE001 - no ptxas here: the kernel load reports what it finds
            pass
    try:
        importlib.import_module("triton.experimental.gluon")
    except ImportError:
        pass


def start(kernels_dir: Path | None = None, cache_root: Path | None = None) -> threading.Thread:
    """Start the warm-up on a daemon thread; nobody needs to join it (a later call of the same functions computes
    or copies only what the thread has not finished). kernels_dir: the core's kernels/<target>/ to install under
    cache_root (helios.kernels.aot_install.runtime_cache_root's answer), None for none."""
    thread = threading.Thread(target=_warm, args=(kernels_dir, cache_root), name="helios-triton-warmup", daemon=True)
    thread.start()
    return thread
