"""The one guarded Triton import (every kernel module takes `tl` and `jit` from here) and shared helpers.

On a machine without Triton, HAS_TRITON is False, `triton` and `tl` are None and the kernel modules still
import (their `*_ref` functions work; their launchers raise). Imports nothing from helios.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator
from contextlib import contextmanager

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # CPU-only install: the torch references and the torch backend still serve
    triton = None
    tl = None
    HAS_TRITON = False

_TRUE = {"1", "true", "on", "yes"}


def interpret_mode() -> bool:
    """True when kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1).

    NOTE: Triton reads the variable when a kernel is decorated, i.e. when its module is first imported;
    set it before importing helios.kernels.* (tests/kernels/conftest.py does).
    """
    if HAS_TRITON:
        try:
            from triton import knobs  # Triton's own parse of the variable (3.4+)

            return bool(knobs.runtime.interpret)
        except (ImportError, AttributeError):
            pass
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


# --- programmatic dependent launch (PDL, sm90+) ----------------------------------------------------------
# A kernel launched with launch_pdl=True may start while the kernel before it on the stream is still running;
# its programs must call `pdl_wait` before touching memory an earlier kernel writes or reads (activations,
# the KV cache, outputs) and may load constant inputs (weights) before it. `pdl_launch_dependents` lets the
# next PDL kernel start early. Both are no-ops unless the USE_PDL constexpr is set, which launchers take from
# `use_pdl(tensor, rows)`.
# NOTE: only one-row launches (batch-1 decode) use it, and by default only where every kernel of the step is ours
# (pdl_scope: the norm-free layers, the GEMV for every projection): there PDL paid (a layer-shaped chain 5% faster,
# benchmarks/gpu_gemv.py; the engine's b=1 step 2.8-2.9 points of the bandwidth limit, H200). Next to cuBLAS
# kernels (batch 16 and up, the other batch-1 paths) it cost up to 2.5% per step instead, so those stay ordinary.
_PDL_FORCED: bool | None = None


@functools.cache
def _capability_major(index: int) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]


def use_pdl(t, rows: int) -> bool:
    """Whether a launch over `rows` rows (tokens, sequences) on t's device uses PDL: one row, CUDA, compute
    capability 9.0+, compiled (not interpreted) kernels, pdl_allowed(). Ahead-of-time compiles for a
    target decide with `forced_pdl`."""
    if rows != 1:
        return False
    if _PDL_FORCED is not None:
        return _PDL_FORCED
    if not HAS_TRITON or not on_gpu(t) or interpret_mode() or not pdl_allowed():
        return False
    if t.device.type == "meta":
        return _TRACE_MAJOR >= 9
    return _capability_major(t.device.index if t.device.index is not None else 0) >= 9



# arrival counters: the split kernels' "last program of a group" handshake (decode_qkv's in-launch merge, the
# recurrent decode steps' conv-state writers), one int32 per group, COUNTER_SLOTS of them per (owner, device)
COUNTER_SLOTS = 1 << 16
_COUNTERS: dict = {}


def arrival_counters(device, owner: str):
    """`owner`'s zeroed arrival counters on `device`: allocated once (a captured graph keeps pointing at them),
    zero between launches (the last program of each group resets its own).

    NOTE: first allocated by a warm-up launch, never inside a graph capture (GraphRunner warms every graph up first)."""
    import torch

    key = (owner, device)
    if key not in _COUNTERS:
        assert not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()), \
            f"{owner}: run once before capturing a graph (its arrival counters are allocated then)"
        _COUNTERS[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=device)
    return _COUNTERS[key]

# --- ahead-of-time tracing (helios.kernels.aot) --------------------------------------------------------------
# A model's decode step runs on `meta` tensors while Triton's compile hook intercepts every launch: the launches'
# specializations (dtypes, alignment from the views' offsets, constexprs) are the GPU's, and no kernel runs. The
# few choices the layers make by device (the GEMV, PDL) read `on_gpu`, which counts meta as a GPU of compute
# capability _TRACE_MAJOR inside `meta_as_gpu`, with _TRACE_SMS streaming multiprocessors (`sm_count`).
_TRACE_MAJOR: int | None = None
_TRACE_SMS = 132


def on_gpu(t) -> bool:
    """Whether the kernels treat t (a tensor or a device) as on a GPU: CUDA, or meta inside meta_as_gpu."""
    device = t.device if hasattr(t, "device") else t
    kind = getattr(device, "type", None) or str(device).split(":")[0]
    return kind == "cuda" or (kind == "meta" and _TRACE_MAJOR is not None)


def sm_count(device) -> int:
    """Streaming multiprocessors of `device`'s GPU, for the launch choices sized by the chip (decode splits): the
    device's own on CUDA, the traced GPU's on meta inside meta_as_gpu, 132 (an H100 / H200) anywhere else."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _TRACE_SMS if device.type == "meta" and _TRACE_MAJOR is not None else 132


@contextmanager
def meta_as_gpu(major: int, num_sms: int = 132) -> Iterator[None]:
    """Meta tensors stand for a GPU of compute capability `major`.x with num_sms multiprocessors inside (on_gpu,
    use_pdl, sm_count)."""
    global _TRACE_MAJOR, _TRACE_SMS
    saved, _TRACE_MAJOR, _TRACE_SMS = (_TRACE_MAJOR, _TRACE_SMS), major, num_sms
    try:
        yield
    finally:
        _TRACE_MAJOR, _TRACE_SMS = saved


_PDL_SCOPE = False  # inside pdl_scope(on): whether one-row launches take PDL


def pdl_allowed() -> bool:
    """Whether one-row launches use PDL: what the innermost pdl_scope says, False outside any. The model enters
    the scope on each forward from its switches (helios.switches: HELIOS_PDL unset = the norm-free decode steps
    only, where every kernel is ours; on = every one-row launch; off = none); nothing here reads the environment.

    NOTE: scoped on measurement (b=1 engine decode of an 8B llama, H200, 2026-12-03, session 6): the norm-free step ran at
    87.6-87.7% of the bandwidth limit with PDL against 84.7-84.9% without; next to cuBLAS projections (the
    other batch-1 paths) PDL made no difference or cost 2-3 points (2026-12-03)."""
    return _PDL_SCOPE


@contextmanager
def pdl_scope(on: bool = True) -> Iterator[None]:
    """One-row launches inside take PDL when `on` (pdl_allowed); the scope before is restored on exit."""
    global _PDL_SCOPE
    saved, _PDL_SCOPE = _PDL_SCOPE, on
    try:
        yield
    finally:
        _PDL_SCOPE = saved


@contextmanager
def forced_pdl(value: bool | None) -> Iterator[None]:
    """use_pdl answers `value` inside (None: the device decides again)."""
    global _PDL_FORCED
    saved, _PDL_FORCED = _PDL_FORCED, value
    try:
        yield
    finally:
        _PDL_FORCED = saved


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the torch reference (*_ref) or the torch backend")


def jit(fn):
    """triton.jit when Triton is present; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


@jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until every kernel this launch depends on has finished and its memory is visible."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Allow the next PDL kernel on the stream to start launching (it still waits in its pdl_wait)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()


@jit
def tanh(y):
    """tanh from one exp of -2|y|: long-standing tl ops only, never overflows, absolute error ~1e-7."""
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y >= 0, t, -t)


@jit
def round_to(x, DT: tl.constexpr):
    """x (float32) rounded to DT, to nearest even, and back to float32: where a torch path holds a 16-bit tensor.
    NOTE: bf16 by its bits, since the interpreter's conversion truncates (the CPU tests would drift)."""
    if DT == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        y = bits.to(tl.float32, bitcast=True)
    elif DT == tl.float32:
        y = x
    else:
        y = x.to(DT).to(tl.float32)
    return y


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_last_dim_contiguous(name: str, t) -> None:
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})"
