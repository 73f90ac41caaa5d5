"""helios.kernels.mhc compiled on CUDA: tests/kernels/test_mhc_kernels.py's checks (the kernels = the torch path,
batched tokens = each alone, bit for bit) at the tests' shapes and at a published one (4 streams of 4096)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_mhc_kernels as checks

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders and exp on the device, FMA contraction


@DTYPES
@pytest.mark.parametrize("num_tokens, hidden", [(1, 300), (9, 300), (1, 4096), (33, 4096)])
def test_pre_matches_the_layer(dtype, num_tokens, hidden):
    checks.check_pre_matches_the_layer("cuda", dtype, num_tokens, hidden=hidden, f32=F32_DEVICE)


@DTYPES
@pytest.mark.parametrize("num_tokens, hidden", [(1, 300), (33, 4096)])
def test_expand_matches_the_layer(dtype, num_tokens, hidden):
    checks.check_expand_matches_the_layer("cuda", dtype, num_tokens, hidden=hidden, f32=F32_DEVICE)


@DTYPES
def test_head_matches_the_reference(dtype):
    checks.check_head_matches_the_reference("cuda", dtype, 5, hidden=4096, f32=F32_DEVICE)


@DTYPES
def test_batched_tokens_equal_each_alone(dtype):
    checks.check_batched_equals_alone("cuda", dtype, num_tokens=9, hidden=4096)
