"""The Triton interpreter's tl.dot as these tests run it (tests/kernels/interpreter.exact_interpreter_dot, patched by
tests/conftest.py): bfloat16 multiplied by value, and a row's sum free of the other rows of its tile, which the
batch-invariance tests of the kernels rely on. Unpatched, the first fails with Triton 3.9 (#11584) and the second
with numpy 2.4's OpenBLAS on AMD EPYC hosts."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import interpreted_dot, probe_dot, require_interpreter

require_interpreter()


def test_the_interpreter_dot_is_by_value_and_row_by_row():
    ok, why = probe_dot()
    assert ok, why


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_interpreter_dot_is_the_float32_product_of_its_operands(dtype):
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randn(16, 64, generator=gen).to(dtype), torch.randn(64, 16, generator=gen).to(dtype)
    want = (a.double() @ b.double()).float()  # exact products; float32 sums stay within a few ulps of it
    torch.testing.assert_close(interpreted_dot(a, b), want, rtol=1e-5, atol=1e-5)
