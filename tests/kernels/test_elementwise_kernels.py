"""Rotary (in place, and fused with norms + the cache write) and gated activation kernels vs their
references."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.interpreter import require_interpreter

require_interpreter()

# the interpreter (numpy) warns on exp overflow / log(0) where the GPU quietly gives inf / -inf
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")

from tests.kernels import checks  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary(dtype):
    checks.check_rotary("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gated_activation(dtype, act):
    checks.check_gated("cpu", dtype, act)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("qk_norm, multiply_in_float32", [(False, False), (True, False), (True, True)])
def test_rotary_and_cache(dtype, qk_norm, multiply_in_float32):
    checks.check_rotary_and_cache("cpu", dtype, qk_norm, multiply_in_float32)

