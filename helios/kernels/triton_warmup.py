"""Triton's first-use costs in a process, paid on a thread beside `import torch` when a GPU server starts.

The first compile or cache lookup of a process computes `triton.runtime.cache.triton_key()`, a sha256 of Triton's
sources and of libtriton.so (~500 MB: ~0.45 s here), and the CUDA backend's hash asks ptxas for its version (a
subprocess). helios.kernels.aot's kernel load needs both, after torch's import, and its 16 threads each computed
the key at once (functools.lru_cache does not hold back concurrent first calls). The hashing and the reads release
the GIL, so on a thread started before torch's import they cost the start little. Nothing here changes what Triton
computes: both values are Triton's own functions' results, cached where Triton caches them.
Imports triton only, inside the thread (never torch): helios.compose starts it before torch is imported.
"""

from __future__ import annotations

import threading


def _warm() -> None:
    try:
        from triton.runtime.cache import triton_key
    except ImportError:  # no triton: the kernel load says so itself
        return
    triton_key()
    try:  # NOTE: the CUDA backend's hash (Triton 3.x); another layout skips it
        from triton.backends.nvidia.compiler import get_ptxas_version
    except ImportError:
        return
    try:
        get_ptxas_version()
    except Exception:  # noqa: BLE001 - no ptxas here: the kernel load reports what it finds
        pass


def start() -> threading.Thread:
    """Start the warm-up on a daemon thread; nobody needs to join it (a later call of either function waits
    for nothing it would not have computed itself)."""
    thread = threading.Thread(target=_warm, name="helios-triton-warmup", daemon=True)
    thread.start()
    return thread
