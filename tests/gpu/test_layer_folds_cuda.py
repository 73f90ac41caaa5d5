"""helios.kernels.relu2, helios.kernels.output_gate and helios.kernels.mamba.mamba2_decode compiled on CUDA: the
checks of tests/kernels/test_layer_folds.py and test_mamba_decode.py at their shapes and at published widths
(nemotron_h's MLP and Mamba-2 mixer, qwen3_5's gated attention), one row and a few. (The Mamba-2 mixer's fused
norm and decode step through the layer: test_recurrent_kernels_cuda.py::test_mamba_layer_matches_the_torch_path.)"""

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



@DTYPES
@pytest.mark.parametrize("starts", [(9,), (0,), (3, 0, 1, 130, 7)])
@pytest.mark.parametrize("shape", [dict(), dict(num_heads=128, num_groups=8, head_dim=64, state_dim=128)],
                         ids=["tiny", "nemotron-nano"])
def test_mamba2_decode_matches_the_two_launch_path(dtype, starts, shape):
    from tests.kernels import test_mamba_decode

    test_mamba_decode.check_mamba2_decode("cuda", dtype, starts=starts, **shape, f32=dict(atol=1e-4, rtol=1e-4))
