"""The MLP and gate folds compiled on CUDA: the checks of tests/kernels/test_gated_clamp.py (the gated kernel with
gated's clamps and alpha; a clamped GatedMLP fused = unfused), test_step3p7_fused.py, test_gemma4_folds.py (soft-cap,
PLE gate, PLE inputs) and test_head_gate.py. bf16 may be one ulp off on a small share: the device's exp, tanh and
rsqrt are not torch's in float32's last bits."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.family_cuda import CUDA_MARKS
from tests.kernels import test_gated_clamp as checks

pytestmark = CUDA_MARKS

DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("limit, clamp_after_act, alpha", checks.VARIANTS)
def test_gated_variant_matches_the_torch_path(dtype, act, limit, clamp_after_act, alpha):
    checks.check_gated_variant("cuda", dtype, act, limit, clamp_after_act, alpha, max_flips=1e-3)


@DTYPES
@pytest.mark.parametrize("limit, clamp_after_act", [(7.0, False), (0.4, True)])
@pytest.mark.parametrize("num_tokens", [1, 9])
def test_clamped_mlp_fused_equals_unfused(dtype, limit, clamp_after_act, num_tokens):
    checks.check_clamped_mlp("cuda", dtype, limit, clamp_after_act, num_tokens, exact=False)


@DTYPES
def test_step3p7_fused_step_equals_the_torch_path(dtype):
    from tests.kernels.test_step3p7_fused import check_fused_step

    check_fused_step("cuda", dtype, exact_bf16=False)  # the act's exp on the device: test_gated_clamp says more


@DTYPES
def test_gemma4_softcap_matches_the_torch_path(dtype):
    from tests.kernels.test_gemma4_folds import check_softcap

    check_softcap("cuda", dtype, max_flips=1e-3)


@DTYPES
@pytest.mark.parametrize("act", ["gelu_tanh", "silu"])
def test_gemma4_ple_gate_matches_the_torch_path(dtype, act):
    from tests.kernels.test_gemma4_folds import check_ple_gate

    check_ple_gate("cuda", dtype, act)


@DTYPES
def test_gemma4_ple_inputs_match_the_torch_path(dtype):
    from tests.kernels.test_gemma4_folds import check_ple_inputs

    check_ple_inputs("cuda", dtype, max_flips=1e-2)


@DTYPES
def test_step3p7_head_gate_matches_the_torch_path(dtype):
    from tests.kernels.test_output_gate_per_head import check_head_gate

    check_head_gate("cuda", dtype, max_flips=1e-3)  # as test_layer_folds_cuda's sigmoid_gate
