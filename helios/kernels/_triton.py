"""The one guarded Triton import (every kernel module takes `tl` and `jit` from here) and shared helpers.

On a machine without Triton, HAS_TRITON is False, `triton` and `tl` are None and the kernel modules still
import (their `*_ref` functions work; their launchers raise). Imports nothing from helios.
"""

from __future__ import annotations

import os

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


def require_triton() -> None:
    if not HAS_TRITON:
        raise RuntimeError("Triton is not installed; use the torch reference (*_ref) or the torch backend")


def jit(fn):
    """triton.jit when Triton is present; otherwise the plain function (never launched)."""
    return triton.jit(fn) if HAS_TRITON else fn


@jit
def tanh(y):
    """tanh from one exp of -2|y|: long-standing tl ops only, never overflows, absolute error ~1e-7."""
    e = tl.exp(-2.0 * tl.abs(y))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(y >= 0, t, -t)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def check_last_dim_contiguous(name: str, t) -> None:
    assert t.stride(-1) == 1, f"{name}: the last dimension must be contiguous (stride {t.stride(-1)})"
