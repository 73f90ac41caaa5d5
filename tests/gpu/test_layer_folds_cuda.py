"""helios.kernels.relu2 and helios.kernels.output_gate compiled on CUDA: tests/kernels/test_layer_folds.py's checks at
the tests' shapes and at published widths (nemotron_h's MLP, qwen3_5's gated attention), one row and a few. (The Mamba-2 mixer's fused norm is
tests/gpu/test_recurrent_kernels_cuda.py::test_mamba_layer_matches_the_torch_path's.)"""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_layer_folds as checks

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SHAPES = pytest.mark.parametrize("num_tokens, width", [(1, 48), (3, 1500), (1, 18560), (5, 8192)])


@DTYPES
@SHAPES
def test_relu2_matches_torch(dtype, num_tokens, width):
    checks.check_relu2("cuda", dtype, num_tokens, width)
    checks.check_relu2("cuda", dtype, num_tokens, width, stride_pad=64)


@DTYPES
@SHAPES
def test_sigmoid_gate_matches_torch(dtype, num_tokens, width):
    # NOTE: Triton's exp (ex2.approx) and torch's expf may differ in float32's last bits, which can flip a bf16
    # rounding by one ulp: rare, so a thousandth of the elements at most
    checks.check_sigmoid_gate("cuda", dtype, num_tokens, width, stride_pad=128, max_flips=1e-3)

