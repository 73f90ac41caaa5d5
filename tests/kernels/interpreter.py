"""Skip a kernel test module unless Triton is importable and its kernels run in the CPU interpreter."""

from __future__ import annotations

import pytest

from helios.kernels._triton import HAS_TRITON, interpret_mode, jit, tl


def require_interpreter() -> None:
    if not HAS_TRITON:
        pytest.skip("triton is not installed", allow_module_level=True)
    if not interpret_mode():
        pytest.skip("kernel CPU tests need TRITON_INTERPRET=1 (on CUDA, tests/gpu runs them)", allow_module_level=True)
    from triton.runtime.interpreter import InterpretedFunction

    from helios.kernels.rmsnorm import _rms_norm_kernel

    if not isinstance(_rms_norm_kernel, InterpretedFunction):
        pytest.skip("helios.kernels was imported before TRITON_INTERPRET was set", allow_module_level=True)


def exact_interpreter_dot() -> None:
    """Make the Triton interpreter's tl.dot on floating operands multiply by value and sum each output in an order
    fixed by its own row and column. The plain one has two faults for these tests:
    - bfloat16 operands: it multiplies their bit patterns (it stores bfloat16 as uint16 and widens only 8-bit floats
      before np.matmul: values ~1e10 out of a 16 x 16 dot; triton-lang/triton#11584, "not supported yet" in 3.9);
    - np.matmul is BLAS, and OpenBLAS's sgemm (numpy 2.4's, on this session's AMD EPYC hosts) sums a row in an order
      that depends on the row's place in the tile: rows 6 and on of a 16-row dot round apart from the same row at
      row 0. A batch-invariance test (a token alone lands at row 0, batched at row t) then parts by a rounding
      (tests/kernels/test_qwen4_hc_kernels.py, float32, session 29; Intel hosts had passed it).
    Here the operands are widened to float32 exactly (bfloat16 is float32's upper half; float16 converts exactly) and
    summed in float32 by np.einsum, whose loop sums each output over k in order whatever the other rows hold, as the
    GPU's tensor cores are free of the batch. tests/conftest.py calls it when the interpreter is on; checked by probes
    here and by tests/kernels/test_interpreter_dot.py."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    plain = getattr(builder.create_dot, "plain_dot", builder.create_dot)
    floats = (tl.bfloat16, tl.float16, tl.float32)

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.scalar not in floats or b.dtype.scalar not in floats:
            return plain(self, a, b, d, input_precision, max_num_imprecise_acc)

        def value(h):
            if h.dtype.scalar == tl.bfloat16:
                return (h.data.astype(np.uint32) << 16).view(np.float32)
            return h.data.astype(np.float32)
        product = np.einsum("...ik,...kj->...ij", value(a), value(b), dtype=np.float32).astype(d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    create_dot.plain_dot = plain
    builder.create_dot = create_dot
    ok, why = probe_dot()
    assert ok, f"the interpreter's tl.dot after the patch: {why}"


@jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, K: tl.constexpr):
    r, k = tl.arange(0, 16), tl.arange(0, K)
    a = tl.load(a_ptr + r[:, None] * K + k[None, :])
    b = tl.load(b_ptr + k[:, None] * 16 + r[None, :])
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, b, input_precision="ieee"))


def interpreted_dot(a, b):
    """tl.dot of a [16, K] by b [K, 16] (K a power of two from 16, any float dtype) in one program: [16, 16] float32
    (IEEE where the operands are float32)."""
    import torch

    out = torch.zeros(16, 16)
    _dot_kernel[(1,)](a.contiguous(), b.contiguous(), out, K=a.shape[1])
    return out


def probe_dot() -> tuple[bool, str]:
    """(whether the interpreter's tl.dot is right, what is wrong): a bfloat16 identity times itself, and each row of
    a float32 16 x 32 by 32 x 16 product equal to that row alone at row 0 of a tile of zeros."""
    import torch

    eye = torch.eye(16, dtype=torch.bfloat16)
    if not torch.equal(interpreted_dot(eye, eye), torch.eye(16)):
        return False, "bfloat16 operands are not multiplied by value"
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 32, generator=gen), torch.randn(32, 16, generator=gen)
    whole = interpreted_dot(a, b)
    for row in range(16):
        alone = torch.zeros(16, 32)
        alone[0] = a[row]
        if not torch.equal(interpreted_dot(alone, b)[0], whole[row]):
            return False, f"row {row} of a float32 dot differs from the same row alone"
    return True, ""
