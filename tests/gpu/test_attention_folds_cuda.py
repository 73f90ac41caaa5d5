"""The attention folds of a batch-1 decode step compiled on CUDA: tests/kernels/test_attention_folds.py's checks
(rms_norm_rope with partial rotary = the torch norms and rotary, the one-launch block choices = the torch sorts, the
K/V and index-key writes = the two launches they replace, the block scores from raw index queries = from the torch
path's normed ones, the block rotary rows = the gathered ones) at the tests' shapes and at published ones (qwen3_5's
256-dim heads with 64 turned, long contexts' block counts).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_attention_folds as checks

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
F32_DEVICE = dict(atol=1e-5, rtol=1e-5)  # the device's rsqrt, other reduction orders, FMA contraction


@DTYPES
@pytest.mark.parametrize("round_products", [True, False], ids=["apply_rotary", "rounded_once"])
@pytest.mark.parametrize("head_dim, rotary_dim, num_tokens", [(48, 24, 3), (256, 64, 1), (256, 64, 7), (128, 128, 1)])
def test_norm_rope(dtype, round_products, head_dim, rotary_dim, num_tokens):
    checks.check_norm_rope("cuda", dtype, head_dim, rotary_dim, round_products=round_products, num_tokens=num_tokens,
                           f32=F32_DEVICE, exact16=False)


@pytest.mark.parametrize("num_blocks, num_kept", [(45, 6), (2048, 32), (16384, 64)])
def test_select_blocks(num_blocks, num_kept):
    checks.check_select_blocks("cuda", num_blocks=num_blocks, num_kept=num_kept)


@pytest.mark.parametrize("num_blocks, num_kept", [(20, 5), (4096, 16)])
def test_top_blocks(num_blocks, num_kept):
    checks.check_top_blocks("cuda", num_blocks=num_blocks, num_kept=num_kept)


@DTYPES
def test_block_rotary_rows(dtype):
    checks.check_block_cos_sin("cuda", dtype)


@DTYPES
@pytest.mark.parametrize("num_kv_heads, head_dim, index_dim", [(2, 48, 24), (4, 128, 128), (8, 128, 256)])
def test_write_caches(dtype, num_kv_heads, head_dim, index_dim):
    checks.check_write_caches("cuda", dtype, num_kv_heads, head_dim, index_dim, page_size=16)


@DTYPES
def test_block_scores_norm_the_queries(dtype):
    # bf16: the device's rsqrt may move a normed query by one 16-bit step
    tol = F32_DEVICE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    checks.check_scores_norm_the_queries("cuda", dtype, tol=tol)
