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


def widen_bfloat16_dot() -> bool:
    """Make the Triton interpreter's tl.dot multiply bfloat16 operands by value, where it multiplies their bit patterns
    (it stores bfloat16 as uint16 and widens only 8-bit floats before np.matmul: values ~1e10 out of a 16 x 16 dot;
    triton-lang/triton#11584, "not supported yet" in 3.9). The operands are widened to float32 exactly (bfloat16 is
    float32's upper half), the products summed in float32 as on the GPU's tensor cores. Patches only where a probe
    dot shows the bug; returns whether it patched. tests/conftest.py calls it when the interpreter is on."""
    import numpy as np
    import torch
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    @triton.jit
    def probe(a_ptr, out_ptr):
        r = tl.arange(0, 16)
        a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
        tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a))

    def dot_is_right() -> bool:
        a = torch.eye(16, dtype=torch.bfloat16)
        out = torch.zeros(16, 16)
        probe[(1,)](a, out)
        return torch.equal(out, torch.eye(16))

    if dot_is_right():
        return False
    builder = interpreter.InterpreterBuilder
    plain = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if tl.bfloat16 not in (a.dtype, b.dtype):
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)

        def value(h):
            return (h.data.astype(np.uint32) << 16).view(np.float32) if h.dtype == tl.bfloat16 else h.data
        product = np.matmul(value(a), value(b), dtype=np.float32).astype(d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot
    assert dot_is_right(), "the interpreter's bfloat16 tl.dot is still wrong after widening its operands"
    return True
