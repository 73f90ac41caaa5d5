"""RMSNorm and fused add + RMSNorm kernels vs their references (Triton interpreter)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels import checks  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("multiply_in_float32", [False, True], ids=["llama", "gemma"])
def test_rms_norm(dtype, multiply_in_float32):
    checks.check_rms_norm("cpu", dtype, multiply_in_float32)


def test_rms_norm_strided_heads():
    checks.check_rms_norm_strided_heads("cpu", torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("multiply_in_float32", [False, True], ids=["llama", "gemma"])
def test_fused_add_rms_norm(dtype, multiply_in_float32):
    checks.check_fused_add_rms_norm("cpu", dtype, multiply_in_float32)
