"""helios.kernels.qwen4_hc compiled on CUDA: tests/kernels/test_qwen4_hc_kernels.py's checks (the kernels = the torch
path, the added streams exact, batched tokens = each alone, bit for bit) at the tests' shapes and at a published one
(4 streams of 2048, rank 320)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_qwen4_hc_kernels as checks

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders and exp on the device, FMA contraction


@DTYPES
@pytest.mark.parametrize("num_tokens, num_streams, hidden, rank", [(1, 3, 96, 40), (9, 3, 96, 40),
                                                                   (1, 4, 2048, 320), (33, 4, 2048, 320)])
def test_mix_matches_the_layer(dtype, num_tokens, num_streams, hidden, rank):
    checks.check_mix_matches_the_layer("cuda", dtype, num_tokens, num_streams=num_streams, hidden=hidden, rank=rank,
                                       f32=F32_DEVICE)


@DTYPES
def test_the_head_and_the_first_mix(dtype):
    checks.check_mix_matches_the_layer("cuda", dtype, 5, num_streams=4, hidden=2048, rank=320, inject=False,
                                       f32=F32_DEVICE)
    checks.check_mix_matches_the_layer("cuda", dtype, 5, num_streams=4, hidden=2048, rank=320, add=False,
                                       f32=F32_DEVICE)


@DTYPES
def test_batched_tokens_equal_each_alone(dtype):
    checks.check_batched_equals_alone("cuda", dtype, num_tokens=33, num_streams=4, hidden=2048, rank=320)
