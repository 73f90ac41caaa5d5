"""helios.kernels.dsa_decode's folded decode launches compiled on CUDA: tests/kernels/test_dsa_folds.py's checks
(write_index_rows = the indexer's LayerNorm and write; pool_scores' raw head weights = the scaled ones bit for bit,
and its folded row write = write_index_rows then pool_scores; sparse_mla_decode_absorbed = the layer's former
launches) in float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_dsa_folds as checks
from tests.kernels.test_dsa_decode import NOPE, ROPE

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
F32_DEVICE = dict(atol=1e-4, rtol=1e-4)  # other reduction orders, exp2 on the device, FMA contraction


@DTYPES
def test_write_index_rows_is_the_layers_write(dtype):
    tol = F32_DEVICE if dtype == torch.float32 else None  # bf16: the rows within two ulps, as on the CPU
    checks.check_write_index_rows("cuda", dtype, tol=tol)


@DTYPES
def test_pool_scores_scale_the_raw_weights_as_project_does(dtype):
    checks.check_raw_weights("cuda", dtype)


@DTYPES
def test_pool_scores_write_the_rows_they_score(dtype):
    checks.check_scores_with_write("cuda", dtype)


@DTYPES
@pytest.mark.parametrize("rope, num_splits", [(False, 1), (True, 2)], ids=["nope-1split", "rope-2splits"])
def test_absorbed_attention_is_the_layers_launches(dtype, rope, num_splits):
    tol = F32_DEVICE if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    checks.check_absorbed("cuda", dtype, ROPE if rope else NOPE, num_splits=num_splits, tol=tol)
