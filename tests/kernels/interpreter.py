"""Skip a kernel test module unless Triton is importable and its kernels run in the CPU interpreter."""

from __future__ import annotations

import pytest

from helios.kernels._triton import HAS_TRITON, interpret_mode


def require_interpreter() -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed", allow_module_level=True)
    if not interpret_mode():
        pytest.skip("kernel CPU tests need TRITON_INTERPRET=1 (on CUDA, tests/gpu runs them)", allow_module_level=True)
    from triton.runtime.interpreter import InterpretedFunction

    from helios.kernels.rmsnorm import _rms_norm_kernel

    if not isinstance(_rms_norm_kernel, InterpretedFunction):
        pytest.skip("helios.kernels was imported before TRITON_INTERPRET was set", allow_module_level=True)
